#!/usr/bin/env bash
# bench's PyTorch side against an independent anchor: a GPT-2 training step written the way a
# PyTorch user writes it, in a file that is not part of this repository (ANCHOR; it takes
# "V D H T B L MODE..." and prints one "ANCHOR MODE ...: X ms/step" line a mode). At each size, the
# anchor at bf16 and bf16+compile, then `toyharness bench gpt2 --precision bf16 --size SIZE`, then
# one table: the anchor's ms beside the twin's (eager and torch.compile) and ours.
#
#   tools/anchor_race.sh [--build] [--backend cuda] [--steps N] [--sizes "nano gpt2-small"]
#                        [--python PY] [--bench "ARGS"] ANCHOR OUT
#
# The anchor's model is bench's at that size (its V D H T B L read from toyharness: the gpt2
# recipe's vocabulary at its bench data, and the size's n_layer, d_model, n_head, t_seq, t_batch).
# --build first builds toyharness with cuda (tools/gpu_env.sh's build_cuda, offline, as
# tools/gpu_check.sh does; its log: OUT/race.log). --backend other than cuda runs bench alone, at
# fp32 (the anchor needs cuda, and bf16 is cuda's): a check that bench's command line holds. --bench adds arguments to bench
# (--set n_layer=1 for a smoke test, say). Each command's output goes to OUT/anchor-SIZE.log and
# OUT/bench-SIZE.log, bench's figures to OUT/bench-SIZE.json.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
backend=cuda steps=20 sizes="nano gpt2-small" py=python3 bench_args="" build=0
while [[ $# -gt 0 && $1 == --* ]]; do
  case $1 in
    --build) build=1; shift ;;
    --backend) backend=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --python) py=$2; shift 2 ;;
    --bench) bench_args=$2; shift 2 ;;
    *) echo "anchor_race.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
if [[ $# -ne 2 ]]; then
  sed -n '8,9p' "$0" | sed 's/^# *//' >&2; exit 2
fi
anchor=$(realpath "$1"); out=$2
[[ -f $anchor ]] || { echo "anchor_race.sh: no anchor file $anchor" >&2; exit 2; }
mkdir -p "$out"
if [[ $build == 1 ]]; then
  log="$out/race.log"
  # shellcheck source=tools/gpu_env.sh
  source "$here/gpu_env.sh"
  (cd "$root" && build_cuda)
fi

# "V D H T B L" of bench's gpt2 at a size, from toyharness's own presets
anchor_sizes() {
  "$py" - "$1" <<'EOF'
import sys
from toyharness.bench import bench_options, size_sets
from toyharness.hookspecs import plugin_manager
from toyharness.runner import load_data

obj, o = bench_options("gpt2", size_sets("gpt2", sys.argv[1]))
vocab = obj.vocab_for(o, load_data(plugin_manager(obj), o).vocab)
print(vocab, o.d_model, o.n_head, o.t_seq, o.t_batch, o.n_layer)
EOF
}

precision=bf16; [[ $backend == cuda ]] || precision=fp32
for size in $sizes; do
  if [[ $backend == cuda ]]; then
    read -r -a shape <<<"$(anchor_sizes "$size")"
    echo "== $size: anchor (V D H T B L: ${shape[*]})" >&2
    "$py" "$anchor" "${shape[@]}" bf16 bf16+compile >"$out/anchor-$size.log" 2>&1 \
      || { echo "anchor_race.sh: the anchor at $size failed:" >&2; tail -20 "$out/anchor-$size.log" >&2; exit 1; }
  fi
  echo "== $size: toyharness bench --backend $backend" >&2
  # shellcheck disable=SC2086  # the extra arguments split on blanks, as typed
  "$py" -m toyharness.cli bench gpt2 --backend "$backend" --precision $precision --torch-modes compile,eager \
    --size "$size" --steps "$steps" --out "$out/bench-$size.json" $bench_args >"$out/bench-$size.log" 2>&1 \
    || { echo "anchor_race.sh: bench at $size failed:" >&2; tail -20 "$out/bench-$size.log" >&2; exit 1; }
done

"$py" - "$out" $precision $sizes <<'EOF'
import json, re, sys
from pathlib import Path

out, precision, sizes = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
print(f"gpt2 at {precision}; the anchor at bf16 and bf16+compile")
print(f"{'size':11s} {'mode':8s} {'anchor':>9s} {'twin':>9s} {'twin/anchor':>11s} {'toyharness':>10s}   (ms/step, median)")
for size in sizes:
    log = out / f"anchor-{size}.log"
    anchor = dict(re.findall(r"^ANCHOR (\S+) .*: ([\d.]+) ms/step", log.read_text(), re.M)) if log.exists() else {}
    r = json.loads((out / f"bench-{size}.json").read_text())["recipes"]["gpt2"]
    twin = {r["torch_mode"]: r["torch_ms_per_step"], "eager": r.get("torch_eager_ms_per_step")}
    for mode, key in (("eager", "bf16"), ("compile", "bf16+compile")):
        a, t = anchor.get(key), twin.get(mode)
        ratio = f"{t / float(a):.3f}" if a and t else "-"
        print(f"{size:11s} {mode:8s} {a or '-':>9} {t if t is not None else '-':>9} {ratio:>11s} "
              f"{r['ms_per_step']:>10.2f}")
EOF
