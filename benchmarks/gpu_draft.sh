#!/usr/bin/env bash
# Issue 19 on a GPU machine: engine restart with and without a draft model's cache group
# (reference engine, speculative decoding); installs nothing from the network.
#
#   OUT=/tmp/vlaunch-gpu bash benchmarks/gpu_draft.sh     # from the repository root
#
# Writes a 16 GiB Llama-8B-shaped target and a one-layer draft of the same vocabulary, then
# runs bench_draft.py at TP 1 and TP 2 (two GPUs when there are two, else --devices 0,0).
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
CK=${CK:-/tmp/vlaunch-ckpt}
timeout -k 5 240 "$PY" -m vlaunch.cache.reference.refmodel "$CK/target" --llama-8b \
    --target-gib 16 --shards 4 --device cuda
timeout -k 5 120 "$PY" -m vlaunch.cache.reference.refmodel "$CK/draft" --llama-8b --layers 1 \
    --seed 1 --shards 1 --device cuda
echo "=== TP 1"
timeout -k 5 240 "$PY" benchmarks/bench_draft.py --model "$CK/target" --draft-model \
    "$CK/draft" --tp 1 --reps "$REPS" 2>&1 | tee "$OUT/draft_tp1.log"
echo "=== TP 2 $DEVICES"
# shellcheck disable=SC2086
timeout -k 5 300 "$PY" benchmarks/bench_draft.py --model "$CK/target" --draft-model \
    "$CK/draft" --tp 2 $DEVICES --reps "$REPS" 2>&1 | tee "$OUT/draft_tp2.log"
compare_figures
