#!/usr/bin/env bash
# Issue 30 items 5-7 on one GPU machine: kill -> first token, ordinary restarts against a
# standby cold and warm (warm-up memory given back, or kept), at TP 1 and TP 2; what a parked
# standby holds on the device; the collectives of two ranks on one GPU (gloo) against nccl;
# the GPU tests. Installs nothing from the network.
#
#   OUT=/tmp/vlaunch-gpu bash benchmarks/gpu_standby.sh     # from the repository root
#
# Carry .whl/ with the nvidia-ml-py wheel (pip download --no-deps -d .whl nvidia-ml-py): it
# is what reports the device figures; without it they are absent and the test stage skips.
# Stages, each under its own time limit (a failed stage does not stop the others; a subset:
# STAGES="tp1 tests"):
#   setup    vlaunch importable (.whl/ into /tmp/site), versions, NVML, nvidia-smi -L
#   ckpt     the 16 GiB Llama-shaped checkpoint (CKPT, default /tmp/vlaunch-ckpt16), if missing
#   tp1      benchmarks/bench_standby.py --tp 1: ordinary, cold, warm, warm-kept
#   tp2      the same at TP 2: over two GPUs where there are two, else both ranks on GPU 0
#            (--devices 0,0: the gloo backend)
#   backend  benchmarks/bench_tp_backend.py: gloo (CUDA tensors, one GPU) against nccl
#   tests    pytest -m gpu tests/test_gpu_standby.py tests/test_engine_layout.py
# Logs and JSON go to $OUT; a short table is printed last. BUDGET (default 580 s) bounds it.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/vlaunch-gpu}
PY=${PY:-python3}
REPS=${REPS:-3}
BUDGET=${BUDGET:-580}
CKPT=${CKPT:-/tmp/vlaunch-ckpt16}
T0=$(date +%s)
mkdir -p "$OUT"
: >"$OUT/summary.txt"
: >"$OUT/session.log"
# shellcheck source=benchmarks/gpu_lib.sh
source benchmarks/gpu_lib.sh
use_checkout

setup() {
    nvidia-smi -L
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    "$PY" -c "import sys, torch, vlaunch.cache as v; print(sys.version.split()[0], 'torch',
torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'vlaunch',
v.__version__)"
    "$PY" -c "from vlaunch.cache.contract.nvml import NVML; s = NVML.sample(); print('NVML:',
'absent: ' + NVML.error if s is None else f'{len(s)} GPU(s)')"
}
export -f setup
export PY

STAGES=" ${STAGES:-setup ckpt tp1 tp2 backend tests} "
want() { [[ $STAGES == *" $1 "* ]]; }
BENCH=("$PY" benchmarks/bench_standby.py --device cuda --model "$CKPT" --reps "$REPS")
want setup && stage setup 60 bash -c setup
if want ckpt && [ ! -f "$CKPT/model.safetensors.index.json" ]; then
    stage ckpt 180 "$PY" -m vlaunch.cache.reference.refmodel "$CKPT" --llama-8b \
        --target-gib 16 --shards 4 --device cuda
fi
want tp1 && stage tp1 240 "${BENCH[@]}" --tp 1 --out "$OUT/standby_tp1.json"
# shellcheck disable=SC2046
want tp2 && stage tp2 280 "${BENCH[@]}" --tp 2 $(tp2_devices) --out "$OUT/standby_tp2.json"
want backend && stage backend 90 "$PY" benchmarks/bench_tp_backend.py --out "$OUT/backend.json"
want tests && stage tests 200 "$PY" -m pytest -m gpu -q -p no:cacheprovider --timeout 180 \
    tests/test_gpu_standby.py tests/test_engine_layout.py

{
    echo
    echo "# vlaunch issue 30 (standby, TP 2 on one GPU, memory) $(date -u +%Y-%m-%dT%H:%M:%SZ)," \
        "$(($(date +%s) - T0))s in all"
    cat "$OUT/summary.txt"
    for name in tp1 tp2; do
        [ -f "$LOGS/$name.log" ] && { echo "## $name"; sed -n '/^| variant/,$p' "$LOGS/$name.log"; }
    done
    [ -f "$LOGS/backend.log" ] && { echo "## backend"; grep '^{' "$LOGS/backend.log"; }
    [ -f "$LOGS/tests.log" ] && tail -n 3 "$LOGS/tests.log"
    compare_figures
} | tee "$OUT/table.txt"
rm -rf "$LOGS"
