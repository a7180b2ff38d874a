#!/usr/bin/env bash
# The portable goldens on another machine's CPU: build the cpu backend from
# the pinned source, say which CPU this is, and check every portable golden bit for bit
# (goldens/cpu-portable/ and the example plugin's), then the portable math's self-test at this
# CPU's ISA levels (tests/test_portable_cross.py; its aarch64 part skips without qemu).
#
#   tools/portable_check.sh OUT_DIR
#
# Offline machines: put the ggml source in .device/ggml (TOYHARNESS_GGML_SRC) and wheels of
# missing Python packages in .whl/, as for tools/gpu_check.sh. The log lands in
# OUT_DIR/portable_check.log; the exit status is 0 only if every golden matched.
set -uo pipefail
out=${1:?usage: tools/portable_check.sh OUT_DIR}
mkdir -p "$out"
log="$out/portable_check.log"
export PYTHONUNBUFFERED=1
. "$(dirname "$0")/offline_env.sh"
status=0

step "this CPU"
{ grep -m1 "model name" /proc/cpuinfo; nproc; grep -m1 -o -w -E "avx512f|avx2" /proc/cpuinfo | sort -u | tr '\n' ' '; echo; } \
    2>&1 | tee -a "$log"

step "build (cpu)"
start=$(date +%s)
python3 -m pip install --no-deps --no-build-isolation --no-index -e . -e plugins/example_bigram >>"$log" 2>&1 \
    || { echo "build failed" | tee -a "$log"; tail -40 "$log"; exit 1; }
echo "build took $(( $(date +%s) - start )) s" | tee -a "$log"
python3 -c "from toyharness.engine import get_engine; print('fast-path fingerprint:', get_engine('cpu').fast_fingerprint())" \
    2>&1 | tee -a "$log"

step "portable goldens, bit for bit"
toyharness golden check gpt2 llama lora lora@q4_k lora@q8_0 vit_tiny warm_start --mode portable 2>&1 | tee -a "$log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
toyharness golden check bigram --dir plugins/example_bigram/goldens --mode portable 2>&1 | tee -a "$log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if grep -q "^SKIP" "$log"; then echo "a golden was skipped" | tee -a "$log"; status=1; fi

step "portable math self-test at this CPU's ISA levels"
python3 -m pytest -q -rs -p no:cacheprovider tests/test_portable_cross.py 2>&1 | tail -8 | tee -a "$log"
step "done, status $status"
exit $status
