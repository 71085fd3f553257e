#!/usr/bin/env bash
# Issue 13 part 1 on a GPU machine, in one call; installs nothing from the network:
#   1. bench_identity on the 16 GiB 318-tensor checkpoint: memo hit, header and sampled
#      identity, full read and full digest, page cache warm and cold (fadvise DONTNEED);
#   2. `vlaunch verify` against a CUDA rank holding that checkpoint (digests of CUDA slabs,
#      copied to host in chunks), timed, then against the same rank after one byte of the file
#      changed (expect exit 79 naming the tensor);
#   3. `vlaunch run --on-rank-exit respawn`: SIGKILL the rank, then `vlaunch verify` against the
#      rank adopted from escrow (it imports the escrowed slab fds to hash them).
#
#   bash benchmarks/gpu_identity.sh     # from the repository root, after gpu_session.sh's setup
#
# CKPT (default /tmp/vlaunch-ckpt16, made with the reference model writer when missing), OUT
# (default /tmp/vlaunch-gpu) and PY (default python3) as in gpu_session.sh; DEVICE (default
# cuda:0; cpu runs the same steps without a GPU).
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
CKPT=${CKPT:-/tmp/vlaunch-ckpt16}
OUT=${OUT:-/tmp/vlaunch-gpu}
DEVICE=${DEVICE:-cuda:0}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH=/tmp/site:/tmp/vl${PYTHONPATH:+:$PYTHONPATH}
if [ ! -f "$CKPT/model.safetensors.index.json" ]; then
    timeout 240 "$PY" -m vlaunch.cache.reference.refmodel "$CKPT" --llama-8b --target-gib 16 \
        --shards 4 --device cuda
fi
timeout 300 "$PY" benchmarks/bench_identity.py --model "$CKPT" --repeat 3 --threads 16 \
    | tee "$OUT/identity.txt"

S=$(mktemp -d)
chmod 700 "$S"
"$PY" -m vlaunch.cache --model "$CKPT" --device "$DEVICE" --socket-dir "$S" --threads 16 \
    2>"$OUT/identity-rank.log" &
RANK=$!
for _ in $(seq 900); do [ -S "$S/rank-0.sock" ] && break; sleep 0.2; done
t=$(date +%s%N)
timeout 240 "$PY" -m vlaunch.launcher.cli verify --socket-dir "$S" --threads 16 \
    2>&1 | tee -a "$OUT/identity.txt"
echo "verify (good cache): rc=${PIPESTATUS[0]} in $((($(date +%s%N) - t) / 1000000)) ms" \
    | tee -a "$OUT/identity.txt"
# one byte in the middle of the first shard's data, changed back afterwards
FILE=$(ls "$CKPT"/*.safetensors | head -1)
OFF=$(( $(stat -c %s "$FILE") / 2 ))
"$PY" - "$FILE" "$OFF" <<'PY'
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(int(sys.argv[2])); b = f.read(1); f.seek(int(sys.argv[2])); f.write(bytes([b[0] ^ 1]))
PY
timeout 240 "$PY" -m vlaunch.launcher.cli verify --socket-dir "$S" --threads 16 \
    2>&1 | tail -n 4 | tee -a "$OUT/identity.txt"
echo "verify (one byte changed): rc=${PIPESTATUS[0]} (expect 79)" | tee -a "$OUT/identity.txt"
"$PY" - "$FILE" "$OFF" <<'PY'
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(int(sys.argv[2])); b = f.read(1); f.seek(int(sys.argv[2])); f.write(bytes([b[0] ^ 1]))
PY
kill "$RANK"
wait "$RANK"
echo "rank exit: $?" | tee -a "$OUT/identity.txt"
grep -E "checkpoint changed|verify|ERROR" "$OUT/identity-rank.log" | tail -n 5
rm -rf "$S"

# 3. a rank respawned from escrow hashes the slabs it adopted
S=$(mktemp -d)
chmod 700 "$S"
"$PY" -m vlaunch.launcher.cli run --model "$CKPT" --device "${DEVICE%%:*}" --socket-dir "$S" \
    --on-rank-exit respawn --threads 16 2>"$OUT/identity-run.log" &
LAUNCHER=$!
status() {  # the launcher's /status as JSON, or nothing
    "$PY" -c "import json, sys, urllib.request
try:
    url = json.load(open(sys.argv[1]))['url']
    print(urllib.request.urlopen(url + '/status', timeout=2).read().decode())
except Exception:
    pass" "$S/launcher.json"
}
rank_pid() {  # rank 0's pid once it is ready
    status | "$PY" -c "import json, sys
s = json.loads(sys.stdin.read() or '{}')
r = s.get('ranks', {}).get('0', {})
print((r.get('pid') or '') if r.get('state') == 'ready' else '')"
}
for _ in $(seq 900); do [ -n "$(rank_pid)" ] && break; sleep 0.2; done
VICTIM=$(rank_pid)
kill -9 "$VICTIM"
for _ in $(seq 900); do
    P=$(rank_pid)
    [ -n "$P" ] && [ "$P" != "$VICTIM" ] && break
    sleep 0.2
done
timeout 240 "$PY" -m vlaunch.launcher.cli verify --socket-dir "$S" --threads 16 \
    2>&1 | tee -a "$OUT/identity.txt"
echo "verify (rank adopted from escrow, pid $VICTIM -> $(rank_pid)): rc=${PIPESTATUS[0]}" \
    | tee -a "$OUT/identity.txt"
kill "$LAUNCHER"
wait "$LAUNCHER"
echo "launcher exit: $?" | tee -a "$OUT/identity.txt"
grep -E "adopted|verify|ERROR" "$OUT/identity-run.log" | tail -n 5
rm -rf "$S"
