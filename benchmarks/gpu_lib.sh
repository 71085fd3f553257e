# Sourced by the benchmarks/gpu_*.sh scripts (from the repository root): the environment every
# GPU run needs, `stage` (one bounded, logged step) and `use_checkout` (vlaunch importable).
# Expects OUT, PY, BUDGET and T0 to be set by the caller before `stage` is used.

# NVLink multicast stays off in every process: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
# benchmarks that record figures write them here (compare_figures prints them against the
# committed ones; merge back with benchmarks/figures.py --merge)
export RECORD_FIGURES=${RECORD_FIGURES:-${OUT:-/tmp/vlaunch-gpu}/summary.json}
LOGS=${LOGS:-$(mktemp -d)}  # one log per stage; $OUT keeps them together in session.log

stage() {  # stage NAME LIMIT_S COMMAND...: run it under a time limit, log it, note its status
    local name=$1 limit=$2 left t rc
    shift 2
    # benchmarks that record figures write them here; merge back with figures.py --merge
    export RECORD_FIGURES=${RECORD_FIGURES:-$OUT/summary.json}
    left=$((BUDGET - ($(date +%s) - T0)))
    if ((left < 15)); then
        echo "$name: skipped, ${left}s left of ${BUDGET}s" | tee -a "$OUT/summary.txt"
        return
    fi
    ((limit > left)) && limit=$left
    t=$(date +%s)
    echo "=== $name ($(date -u +%H:%M:%S) UTC, limit ${limit}s): $*" | tee -a "$OUT/session.log"
    timeout -k 5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    cat "$LOGS/$name.log" >>"$OUT/session.log"
    echo "$name: rc=$rc in $(($(date +%s) - t))s (limit ${limit}s)" | tee -a "$OUT/summary.txt"
    if ((rc != 0)); then
        tail -n 12 "$LOGS/$name.log" | sed 's/^/    /' >>"$OUT/summary.txt"
    fi
}

use_checkout() {  # make this checkout's vlaunch importable without installing anything
    "$PY" -c "import vlaunch.launcher.cli" 2>/dev/null && return
    mkdir -p /tmp/site /tmp/vl/vlaunch
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    fi
    ln -sfn "$PWD/cache" /tmp/vl/vlaunch/cache
    ln -sfn "$PWD/launcher" /tmp/vl/vlaunch/launcher
    export PYTHONPATH=/tmp/site:/tmp/vl${PYTHONPATH:+:$PYTHONPATH}
}

tp2_devices() {  # --devices for two ranks: none with two GPUs or more, else both on GPU 0
    if (($(nvidia-smi -L | wc -l) < 2)); then echo "--devices 0,0"; fi
}

compare_figures() {  # the headline figures this run recorded against the committed ones
    echo "## figures against the committed summary (benchmarks/results/summary.json)"
    "$PY" benchmarks/figures.py --compare "$OUT/summary.json"
}

