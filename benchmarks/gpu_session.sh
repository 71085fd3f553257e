#!/usr/bin/env bash
# One GPU session for issue 15 item 1 (split reads) and issue 16 (load and handoff at the
# hardware limit) on a fresh H200 machine; installs nothing from the network.
#
#   bash benchmarks/gpu_session.sh          # from the repository root, with .whl/ carried
#
# Stages, each with its own time limit; a failed stage does not stop the others:
#   setup    sdnotify from .whl/ into /tmp/site, vlaunch importable, versions, nvidia-smi -L
#   smoke    (SMOKE=1) the CUDA slab backend (ctypes driver layer): allocate, export, import
#   ckpt     the 16 GiB 318-tensor Llama-shaped checkpoint on the local disk (once)
#   layouts  first load per rank, warm: TP 1, TP 2, TP 4 (two ranks a GPU) and PP 2
#   cold     (not by default) the same from an evicted page cache, against O_DIRECT reads
#   sweep    warm reader by threads and chunk against pinned H2D, plain reads and safetensors
#   loadparts (not by default) a TP 1 first load taken apart in fresh processes
#   handoff  import vlaunch.cache + share load() in fresh processes; copy against D2D
#   placement (not by default) the share handoff by the CPUs its process may run on
#            (HANDOFF_PARTS=0: without copy mode taken apart, the race and the fingerprint)
#   tests    pytest -m gpu: every GPU test (see benchmarks/results/ for its time)
#   imports  what the reference engine imports after torch (the restart floor's make-up)
#   restart  engine SIGKILL -> weights ready again, against bare torch + CUDA (if time is left)
# With two GPUs or more, ranks spread over them (TP 4: two ranks a GPU); with one, every rank
# shares GPU 0. Logs and JSON go to $OUT (default /tmp/vlaunch-gpu); a short table is printed
# last. BUDGET (default 300 s) bounds the whole run; CKPT moves the checkpoint.
set -u
cd "$(dirname "$0")/.."
# shellcheck source=benchmarks/gpu_lib.sh
source benchmarks/gpu_lib.sh
OUT=${OUT:-/tmp/vlaunch-gpu}
mkdir -p "$OUT"
BUDGET=${BUDGET:-300}
CKPT=${CKPT:-/tmp/vlaunch-ckpt16}
PY=${PY:-python3}
T0=$(date +%s)
: >"$OUT/summary.txt"
: >"$OUT/session.log"

setup() {
    mkdir -p /tmp/site
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || {
        echo "editable install failed: importing vlaunch through a link directory"
        mkdir -p /tmp/vl/vlaunch
        ln -sfn "$PWD/cache" /tmp/vl/vlaunch/cache
        ln -sfn "$PWD/launcher" /tmp/vl/vlaunch/launcher
    }
    # byte-compile now, as an installed package is: the handoff's import figure must not
    # include compiling vlaunch's sources (run 1 of 2026-11-30 did, with bytecode writing off)
    "$PY" -m compileall -q cache launcher benchmarks tests >/dev/null
    nvidia-smi -L
    nvidia-smi topo -m 2>/dev/null | head -8
    lscpu 2>/dev/null | grep -i -E "numa|model name|^cpu\(s\)|per core|per socket"
    "$PY" -c "import sys, torch, vlaunch.cache as v; print(sys.version.split()[0], 'torch',
torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'vlaunch',
v.__version__, v.__file__)"
    uname -r
    nproc
    free -g | head -2
    df -h /tmp | tail -1
}

imports() {  # what the handoff and the reference engine import after torch (restart floor)
    local what
    for what in vlaunch.cache.client.loader vlaunch.cache.reference.engine; do
        "$PY" -X importtime -c "import time, torch; t = time.perf_counter()
import $what
print(f'## import $what after torch: {(time.perf_counter() - t) * 1e3:.1f} ms')" \
            2>"$LOGS/importtime.txt"
        "$PY" - "$LOGS/importtime.txt" <<'EOF2'
import sys
rows, seen_torch = [], False
for line in open(sys.argv[1]):
    parts = line.split("|")
    if not line.startswith("import time:") or len(parts) != 3 or "cumulative" in line:
        continue
    name = parts[2].rstrip("\n")[1:]  # after the bar's space, two spaces per level
    if name == "torch":
        seen_torch = True
    elif seen_torch and len(name) - len(name.lstrip()) <= 4:  # three levels
        rows.append((int(parts[1]), int(parts[0].split(":")[1]), name))
for cum, own, name in sorted(rows, reverse=True)[:12]:
    print(f"{cum / 1e3:7.1f} ms (own {own / 1e3:5.1f})  {name}")
EOF2
    done
}

export PYTHONPATH=/tmp/site:/tmp/vl${PYTHONPATH:+:$PYTHONPATH}
export -f setup imports
export PY LOGS
if [ "${SETUP:-1}" = 1 ]; then
    stage setup 90 bash -c setup
fi
if [ "${SMOKE:-0}" = 1 ]; then  # passed in runs 1 and 2; tests/test_slabs_cuda.py covers it
    stage smoke 60 "$PY" benchmarks/cuda_smoke.py --big-gib 4 --repeats 3
fi
STAGES=" ${STAGES:-layouts sweep handoff tests imports restart} "  # a subset: STAGES="layouts tests"
want() { [[ $STAGES == *" $1 "* ]]; }
needs_ckpt() { local s; for s in layouts cold sweep loadparts handoff placement restart; do want $s && return; done; return 1; }
if needs_ckpt && [ ! -f "$CKPT/model.safetensors.index.json" ]; then
    stage ckpt 180 "$PY" -m vlaunch.cache.reference.refmodel "$CKPT" --llama-8b --target-gib 16 \
        --shards 4 --device cuda
fi
LOAD=("$PY" benchmarks/bench_gpu_load.py --model "$CKPT" --device cuda:0)
LAYOUTS=${LAYOUTS:-tp1,tp2,tp4,pp2,tp2:span,tp1:register,tp2:register,tp4:register,pp2:register}
want layouts && stage layouts 200 "${LOAD[@]}" --steps layouts --layouts "$LAYOUTS" --json "$OUT/layouts.json"
want cold && stage cold 200 "${LOAD[@]}" --steps layouts --cold --layouts "${COLD_LAYOUTS:-tp1,tp2,pp2}" --json "$OUT/cold.json"
want sweep && stage sweep 120 "${LOAD[@]}" --steps sweep --json "$OUT/sweep.json"
want loadparts && stage loadparts 120 "${LOAD[@]}" --steps loadparts --json "$OUT/loadparts.json"
want handoff && stage handoff 240 "${LOAD[@]}" --steps handoff --json "$OUT/handoff.json"
want placement && stage placement 200 "${LOAD[@]}" --steps placement --json "$OUT/placement.json"
want tests && stage tests "${TESTS_LIMIT:-240}" "$PY" -m pytest -m gpu -q -p no:cacheprovider \
    --timeout 150 -rfE tests
want imports && stage imports 60 bash -c imports
want restart && stage restart 120 "$PY" benchmarks/bench_gpu_restart.py --model "$CKPT" --device cuda --reps 2

{
    echo
    echo "# vlaunch GPU session $(date -u +%Y-%m-%dT%H:%M:%SZ), $(($(date +%s) - T0))s in all"
    cat "$OUT/summary.txt"
    for name in layouts cold sweep loadparts handoff placement imports restart; do
        [ -f "$LOGS/$name.log" ] && sed -n '/^## /,$p' "$LOGS/$name.log"
    done
    [ -f "$LOGS/smoke.log" ] && grep -E "^(PASS|FAIL)" "$LOGS/smoke.log" | cut -c1-110
    [ -f "$LOGS/tests.log" ] && tail -n 4 "$LOGS/tests.log"
    compare_figures
} | tee "$OUT/table.txt"
rm -rf "$LOGS"
