# Sourced by the device-machine scripts (gpu_check.sh, portable_check.sh): an offline machine
# gets the ggml source from .device/ggml and missing Python packages from wheels in .whl/.
# Defines step() for the log named by $log.
if [ -d .device/ggml ]; then export TOYHARNESS_GGML_SRC="${TOYHARNESS_GGML_SRC:-$PWD/.device/ggml}"; fi
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
step() { echo "== $* ($(date +%T))" | tee -a "$log"; }
