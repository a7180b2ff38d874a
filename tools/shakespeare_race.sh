#!/usr/bin/env bash
# The shakespeare-char race: toyharness's gpt2 at nanoGPT's baby-GPT config against the PyTorch
# script, seed by seed, then the table (tools/shakespeare_race.py). Offline: the corpus is a file
# made beforehand (python -m toyharness.data.corpora shakespeare shakespeare.txt) and carried.
#
#   tools/shakespeare_race.sh [--build] [--backend cuda] [--target 1.47] [--python PY] [--ours "ARGS"]
#                             [--torch "ARGS"] [--sides ours,torch] CORPUS OUT [SEED...]
#                                                                  (seeds: 1337 unless named)
#
# Ours: toyharness run gpt2 --config plugins/toyharness_recipes/configs/shakespeare_char.toml
#       --backend B (cuda: --set precision=bf16) --set seed=S --set data=CORPUS --out OUT/ours-S
# Torch: PY tools/nanogpt_shakespeare_torch.py CORPUS --seed S --target T --log OUT/torch-S.jsonl
#        (--device cpu --no-compile where --backend is not cuda)
# --build first builds toyharness with cuda on the GPU machine (tools/gpu_env.sh's build_cuda, offline,
# as tools/gpu_check.sh does; its log: OUT/race.log). --ours / --torch add arguments to one side (a smaller model for a smoke test, say). Each side's
# output goes to OUT/ours-S.log and OUT/torch-S.log; its whole command's seconds to OUT/process-S.txt.
# --sides runs one side alone (a GPU call's time limit may not hold both for every seed); the table
# reads whatever the OUT folder holds.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
backend=cuda target=1.47 py=python3 ours_args="" torch_args="" build=0 sides=ours,torch
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --build) build=1; shift ;;
    --backend) backend=$2; shift 2 ;;
    --target) target=$2; shift 2 ;;
    --python) py=$2; shift 2 ;;
    --ours) ours_args=$2; shift 2 ;;
    --torch) torch_args=$2; shift 2 ;;
    --sides) sides=$2; shift 2 ;;
    *) echo "shakespeare_race.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
if [[ $# -lt 2 ]]; then
  sed -n '6,7p' "$0" | sed 's/^# *//' >&2; exit 2
fi
corpus=$(realpath "$1"); out=$2; shift 2
seeds=("$@"); [[ ${#seeds[@]} -gt 0 ]] || seeds=(1337)
[[ -f $corpus ]] || { echo "shakespeare_race.sh: no corpus file $corpus" >&2; exit 2; }
pinned=1824186779d4ce04ff287192132e1cfecc1c5238fe76c11489b501fea3ae08a8
got=$(sha256sum "$corpus" | cut -d' ' -f1)
[[ $got == "$pinned" ]] || echo "note: $corpus has sha256 $got, not the pinned shakespeare corpus" >&2
mkdir -p "$out"
if [[ $build == 1 ]]; then
  log="$out/race.log"
  # shellcheck source=tools/gpu_env.sh
  source "$here/gpu_env.sh"
  (cd "$root" && build_cuda)
fi
config="$root/plugins/toyharness_recipes/configs/shakespeare_char.toml"
precision=(); torch_device=()
if [[ $backend == cuda ]]; then precision=(--set precision=bf16); else torch_device=(--device cpu --no-compile); fi

now() { date +%s.%N; }
for seed in "${seeds[@]}"; do
  t0=$(now) t1=$(now)
  if [[ ,$sides, == *,ours,* ]]; then
    echo "== seed $seed: toyharness ($backend)" >&2
    # shellcheck disable=SC2086  # the extra arguments split on blanks, as typed
    toyharness run gpt2 --config "$config" --backend "$backend" "${precision[@]}" --set seed="$seed" \
      --set data="$corpus" --out "$out/ours-$seed" --no-progress $ours_args >"$out/ours-$seed.log" 2>&1
    t1=$(now)
    echo "toyharness $(awk "BEGIN{print $t1 - $t0}")" >>"$out/process-$seed.txt"
  fi
  if [[ ,$sides, == *,torch,* ]]; then
    echo "== seed $seed: torch" >&2
    # shellcheck disable=SC2086
    "$py" "$here/nanogpt_shakespeare_torch.py" "$corpus" --seed "$seed" --target "$target" "${torch_device[@]}" \
      --log "$out/torch-$seed.jsonl" $torch_args >"$out/torch-$seed.log" 2>&1
    echo "torch $(awk "BEGIN{print $(now) - $t1}")" >>"$out/process-$seed.txt"
  fi
done
python3 "$here/shakespeare_race.py" "$out" --target "$target"
