#!/usr/bin/env bash
# Issue 17 on a GPU machine: engine SIGKILL -> first token with and without `vlaunch run
# --standby` (reference engine), and what a parked standby holds on the device; installs
# nothing from the network.
#
#   OUT=/tmp/vlaunch-gpu bash benchmarks/gpu_standby.sh     # from the repository root
#
# TP 1 on GPU 0; TP 2 over two GPUs when there are two, else both ranks on GPU 0 (--devices
# 0,0). JSON per run and the benchmark's output go to $OUT; each stage is bounded by timeout.
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
echo "=== TP 1"
timeout -k 5 240 "$PY" benchmarks/bench_standby.py --device cuda --tp 1 --reps "$REPS" \
    --out "$OUT/standby_tp1.json" 2>&1 | tee "$OUT/standby_tp1.log"
echo "=== TP 2 $DEVICES"
# shellcheck disable=SC2086
timeout -k 5 300 "$PY" benchmarks/bench_standby.py --device cuda --tp 2 $DEVICES \
    --reps "$REPS" --out "$OUT/standby_tp2.json" 2>&1 | tee "$OUT/standby_tp2.log"
