#!/usr/bin/env bash
# The cpu speed acceptance on an x86-64 machine, side by side: the fast cpu path built for this CPU
# (native: AVX-512 where it has it) and for AVX2 (TOYHARNESS_SIMD=avx2, OpenBLAS's Haswell kernel
# by OPENBLAS_CORETYPE=Haswell), each bench beside PyTorch eager, 2 threads pinned with taskset.
#
#   tools/cpu_speed_check.sh OUT_DIR [quick]
#
# Runs, for each build, one after the other for each row so that the machine's drift falls on
# both: every recipe at its default bench config, gpt2 and llama at `--size nano --set t_batch=8`,
# and LoRA over SmolLM2-135M-Instruct Q4_1 (t_seq 64 x 16, targets q, rank 8); and checks both
# builds' goldens bit for bit. Writes OUT_DIR/acceptance.md (every figure's build, speedup and
# target, and the nano step's share of the sgemm ceiling), each bench's json and log, and
# cpu_speed_check.log. `quick` runs tiny configs only (to test this script, not to measure).
#
# Environment: CPU_SPEED_CPUS (default 2,3: two cores of one CCX on a quiet machine; CPU 0 takes
# interrupts), CPU_SPEED_STEPS (timed steps a side, default 20; LoRA 10), SMOLLM2_GGUF (the Q4_1
# file; else .device/SmolLM2-135M-Instruct.Q4_1.gguf, else toyharness's model cache; without it
# the LoRA row is skipped, saying so). Offline machines: the ggml source in .device/ggml and
# wheels in .whl/, as for tools/gpu_check.sh (tools/offline_env.sh).
set -uo pipefail
out=${1:?usage: tools/cpu_speed_check.sh OUT_DIR [quick]}
quick=${2:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
log="$out/cpu_speed_check.log"
export PYTHONUNBUFFERED=1
. "$(dirname "$0")/offline_env.sh"
cpus=${CPU_SPEED_CPUS:-2,3}
steps=${CPU_SPEED_STEPS:-20}
work=${TMPDIR:-/tmp}/cpu_speed_check.$$
mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
status=0

step "this machine"
{ grep -m1 "model name" /proc/cpuinfo; echo "cores: $(nproc)"; uptime; git log --oneline -1 2>/dev/null
  grep -m1 -o -w -E "avx512f" /proc/cpuinfo || echo "no avx512f"; } 2>&1 | tee -a "$log"
if ! taskset -c "$cpus" true 2>/dev/null; then
    echo "taskset -c $cpus failed: set CPU_SPEED_CPUS to two CPUs of this machine" | tee -a "$log"
    exit 2
fi

# build NAME SIMD: the libraries into $work/NAME (ggml's build folders are cached, keyed by SIMD)
builds=()
build() {
    step "build $1 (TOYHARNESS_SIMD=$2)"
    if TOYHARNESS_SIMD=$2 python3 native/build.py --out "$work/$1" >>"$log" 2>&1; then
        builds+=("$1")
    else
        echo "build $1 failed (see $log)" | tee -a "$log"
        status=1
    fi
}
build native native
build avx2 avx2
[ ${#builds[@]} -gt 0 ] || exit 1

# env_for NAME: the environment of a build's runs
env_for() {
    echo "TOYHARNESS_NATIVE_DIR=$work/$1"
    # PyTorch's side as on an AVX2 CPU too: its own kernels (ATen) and MKL's sgemm held to AVX2
    if [ "$1" = avx2 ]; then echo "OPENBLAS_CORETYPE=Haswell ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2"; fi
}

for b in "${builds[@]}"; do
    step "goldens of the $b build, bit for bit"
    # shellcheck disable=SC2046
    env $(env_for "$b") python3 -m toyharness.cli golden check --mode fast 2>&1 | tee -a "$log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done

# bench ROW ARGS...: the row for each build, one after the other (in turn: the order flips per row)
rows=()
flip=0
bench() {
    local row=$1 order=("${builds[@]}")
    shift
    if [ $flip -eq 1 ] && [ ${#order[@]} -eq 2 ]; then order=("${order[1]}" "${order[0]}"); fi
    flip=$((1 - flip))
    for b in "${order[@]}"; do
        step "bench $row, $b build: $*"
        # shellcheck disable=SC2046
        env $(env_for "$b") taskset -c "$cpus" python3 -m toyharness.cli bench "$@" --threads 2 \
            --out "$out/bench_${row}_$b.json" >"$out/bench_${row}_$b.log" 2>&1
        local rc=$?
        cat "$out/bench_${row}_$b.log" >>"$log"
        head -1 "$out/bench_${row}_$b.log"
        if [ $rc -ne 0 ]; then
            echo "bench $row on $b failed (rc $rc): $(tail -1 "$out/bench_${row}_$b.log")" | tee -a "$log"
            status=1
        fi
    done
    rows+=("$row")
}

smollm2=${SMOLLM2_GGUF:-}
if [ -z "$smollm2" ] && [ -f .device/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
    smollm2=$PWD/.device/SmolLM2-135M-Instruct.Q4_1.gguf
fi
if [ -z "$smollm2" ]; then
    smollm2=$(python3 -c "from toyharness.lm import cache_root; from toyharness.pretrained_ggufs import SMOLLM2 as m
p = cache_root() / 'models' / f'{m.package}-{m.version}' / m.file
print(p if p.is_file() else '')" 2>>"$log")
fi

if [ "$quick" = quick ]; then
    tiny=(--set n_layer=1 --set d_model=64 --set n_head=2)
    bench default gpt2 llama --steps 10 --warmup 1 "${tiny[@]}"
    bench nano gpt2 --size nano --steps 10 --warmup 1 --set t_batch=1 --set t_seq=64 --set n_layer=1
else
    bench default --steps "$steps"
    bench nano gpt2 llama --size nano --set t_batch=8 --steps "$steps"
fi
if [ -n "$smollm2" ] && [ -f "$smollm2" ]; then
    if [ "$quick" = quick ]; then
        bench lora_smollm2 lora --set "base=$smollm2" --set t_seq=16 --set t_batch=2 --set targets=q --set rank=8 \
            --steps 10 --warmup 1
    else
        bench lora_smollm2 lora --set "base=$smollm2" --set t_seq=64 --set t_batch=16 --set targets=q --set rank=8 \
            --steps "${CPU_SPEED_LORA_STEPS:-10}"
    fi
else
    echo "SKIP lora_smollm2: no SmolLM2-135M-Instruct.Q4_1.gguf (set SMOLLM2_GGUF)" | tee -a "$log"
fi

step "acceptance table"
python3 - "$out" "$cpus" "${builds[*]}" "${rows[*]}" <<'EOF' 2>&1 | tee -a "$log"
import json, os, sys
out, cpus, builds, rows = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split()
# the targets: every recipe at its default >= 1.5x PyTorch, gpt2 and llama at nano >= 1.2x, LoRA Q4_1 >= 1.5x
target = {"default": 1.5, "nano": 1.2, "lora_smollm2": 1.5}
lines = ["| row | recipe | build | fingerprint | toyharness ms | PyTorch ms | speedup | target | met | sgemm ceiling |",
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
head = []
missed = 0
for row in rows:
    for b in builds:
        path = os.path.join(out, f"bench_{row}_{b}.json")
        if not os.path.isfile(path):
            lines.append(f"| {row} | - | {b} | - | failed | | | | no | |")
            missed += 1
            continue
        doc = json.load(open(path))
        head.append(f"- `{row}` on `{b}`: SIMD {doc.get('simd')}, BLAS {doc.get('blas')}, "
                    f"fp32 sgemm ceiling {doc.get('fp32_ceiling_gflops')} GFLOP/s")
        for name, r in doc["recipes"].items():
            met = r["speedup"] >= target.get(row, 1.5)
            missed += not met
            ceil = f"{r['ceiling_pct']}%" if "ceiling_pct" in r else "-"
            lines.append(f"| {row} | {name} | {b} | {doc['fingerprint']} | {r['ms_per_step']:.2f} | "
                         f"{r['torch_ms_per_step']:.2f} | {r['speedup']:.2f}x | {target.get(row, 1.5)}x | "
                         f"{'yes' if met else 'no'} | {ceil} |")
text = (f"# cpu speed check\n\n2 threads pinned to CPUs {cpus} (taskset); PyTorch eager on the same CPUs; "
        f"load at the end {os.getloadavg()}.\n\n" + "\n".join(head) + "\n\n" + "\n".join(lines) + "\n")
open(os.path.join(out, "acceptance.md"), "w").write(text)
print(text)
print(f"{missed} rows below target" if missed else "every row met its target")
EOF
step "done, status $status"
exit $status
