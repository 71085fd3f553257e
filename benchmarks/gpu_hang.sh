#!/usr/bin/env bash
# Issue 30 on a GPU machine: engine hang -> first token against kill -> first token, ordinary
# vs `vlaunch run --standby` (reference engine, --engine-watchdog 2 --engine-unhealthy-after 2
# --stop-timeout 2); installs nothing from the network.
#
#   OUT=/tmp/vlaunch-gpu [MODEL=/models/ref-16g] bash benchmarks/gpu_hang.sh   # repository root
#
# MODEL: a reference-engine checkpoint directory (default: a small random one per run).
# TP 1 on GPU 0, a SIGSTOPped engine and a stalled serving loop, then the SIGSTOPped engine under
# --engine-hang-kill-after 0 (SIGKILL at once: the standby serves as soon as it is gone); TP 2
# over two GPUs when there are two, else both ranks on GPU 0 (--devices 0,0). JSON per run and
# the logs go to $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/vlaunch-gpu}
PY=${PY:-python3}
REPS=${REPS:-3}
mkdir -p "$OUT"
# shellcheck source=benchmarks/gpu_lib.sh
source benchmarks/gpu_lib.sh
use_checkout
nvidia-smi -L
DEVICES=$(tp2_devices)
MODEL_ARGS=()
[[ -n ${MODEL:-} ]] && MODEL_ARGS=(--model "$MODEL")
for hang in sigstop stall; do
    echo "=== TP 1, $hang"
    timeout -k 5 300 "$PY" benchmarks/bench_hang.py --device cuda --tp 1 --hang "$hang" \
        --reps "$REPS" "${MODEL_ARGS[@]}" --out "$OUT/hang_tp1_$hang.json" 2>&1 |
        tee "$OUT/hang_tp1_$hang.log"
done
echo "=== TP 1, sigstop, --engine-hang-kill-after 0 (SIGKILL at once)"
timeout -k 5 300 "$PY" benchmarks/bench_hang.py --device cuda --tp 1 --hang sigstop \
    --hang-kill-after 0 --reps "$REPS" "${MODEL_ARGS[@]}" --out "$OUT/hang_tp1_kill0.json" 2>&1 |
    tee "$OUT/hang_tp1_kill0.log"
echo "=== TP 2 $DEVICES, sigstop"
# shellcheck disable=SC2086
timeout -k 5 360 "$PY" benchmarks/bench_hang.py --device cuda --tp 2 $DEVICES --hang sigstop \
    --reps "$REPS" "${MODEL_ARGS[@]}" --out "$OUT/hang_tp2_sigstop.json" 2>&1 |
    tee "$OUT/hang_tp2_sigstop.log"
compare_figures
