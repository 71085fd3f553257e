#!/usr/bin/env bash
# Issue 37 part 3 on one GPU machine: refused and failed requests, and the wait clients see,
# across an engine SIGKILL, a double and an in-place swap and SIGHUP, with the engine binding
# its own port against `vlaunch run --listen` (benchmarks/bench_listen.py), on the 16 GiB
# Llama-shaped checkpoint of the issue's table (TP 1, --standby), 1 and 8 clients.
# Installs nothing from the network.
#
#   OUT=/tmp/vlaunch-gpu bash benchmarks/gpu_listen.sh     # from the repository root
#
# Stages (STAGES="setup ckpt listen" by default; each bounded, a failed one does not stop the
# next): setup (versions, nvidia-smi -L), ckpt (CKPT and its twin CKPT2, seed 1, if missing),
# listen (the benchmark; MODES=port,listen, REPS=1, CLIENTS=1,8); probe (not by default: the
# steps of an in-place copy alone, benchmarks/probe_inplace.py). Logs and JSON go to $OUT, figures to
# $OUT/summary.json (merge with benchmarks/figures.py --merge); a short table is printed last.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/vlaunch-gpu}
PY=${PY:-python3}
REPS=${REPS:-1}
MODES=${MODES:-port,listen}
EVENTS=${EVENTS:-kill,double,in-place,sighup}
CLIENTS=${CLIENTS:-1,8}
BUDGET=${BUDGET:-560}
CKPT=${CKPT:-/tmp/vlaunch-ckpt16}
CKPT2=${CKPT2:-/tmp/vlaunch-ckpt16b}
T0=$(date +%s)
mkdir -p "$OUT"
: >"$OUT/summary.txt"
: >"$OUT/session.log"
# shellcheck source=benchmarks/gpu_lib.sh
source benchmarks/gpu_lib.sh
use_checkout

STAGES=" ${STAGES:-setup ckpt listen} "
want() { [[ $STAGES == *" $1 "* ]]; }
want setup && stage setup 60 bash -c 'nvidia-smi -L; "$0" -c "import torch, vlaunch.cache as v;
print(\"torch\", torch.__version__, \"gpus\", torch.cuda.device_count(), \"vlaunch\", v.__version__)"' "$PY"
want probe && stage probe 120 "$PY" benchmarks/probe_inplace.py --gib 16 --reps 3
if want ckpt; then
    for pair in "$CKPT:0" "$CKPT2:1"; do
        dir=${pair%:*} seed=${pair##*:}
        [ -f "$dir/model.safetensors.index.json" ] && continue
        stage "ckpt-seed$seed" 200 "$PY" -m vlaunch.cache.reference.refmodel "$dir" --llama-8b \
            --target-gib 16 --shards 4 --seed "$seed" --device cuda
    done
fi
want listen && stage listen 420 "$PY" benchmarks/bench_listen.py --device cuda --tp 1 \
    --model "$CKPT" --twin "$CKPT2" --modes "$MODES" --events "$EVENTS" --reps "$REPS" \
    --clients "$CLIENTS" \
    --out "$OUT/listen_tp1.json"

{
    echo
    echo "# vlaunch issue 37 (--listen, one H200) $(date -u +%Y-%m-%dT%H:%M:%SZ)," \
        "$(($(date +%s) - T0))s in all"
    cat "$OUT/summary.txt"
    [ -f "$LOGS/probe.log" ] && { echo "## in-place copy probe"; cat "$LOGS/probe.log"; }
    [ -f "$LOGS/listen.log" ] && sed -n '/^mode /,$p' "$LOGS/listen.log"
    # the steps behind each figure: the launcher's and engines' lines around each change
    for log in "$OUT"/listen_tp1.json.*.log; do
        [ -f "$log" ] || continue
        echo "## steps ($(basename "$log"))"
        grep -E "SIGKILL|exited|swap (done|to)|cutting over|cutover|promoting|drain|engine ready|scratch|warm-up|weights from|parked" \
            "$log" | cut -c12-220 | head -n 120
    done
    compare_figures
} | tee "$OUT/table.txt"
rm -rf "$LOGS"
