#!/usr/bin/env bash
# Two containers with docker run: the cache ranks in NAME-cache, the engine in NAME-engine, the
# sockets on a tmpfs volume between them (docs/docker.md explains what is shared and why).
#   GPUS='"device=0,1"' ./two-containers.sh up       the caches (once ready), then the engine
#   GPUS='"device=0,1"' ./two-containers.sh engine   replace the engine; the weights stay loaded
#   ./two-containers.sh down                         remove both containers and the socket volume
# (`caches` alone starts the socket volume and the caches, and waits until they serve.)
# GPUS: the GPUs both containers get, in the same order; unset, the weights stay on the CPU.
# VLAUNCH_IMAGE, VLAUNCH_MODELS (the host directory that holds llama/), VLAUNCH_NAME (llama),
# VLAUNCH_PORT: the image, the checkpoints, the containers' name prefix, the engine's host port.
set -euo pipefail
name=${VLAUNCH_NAME:-llama}
image=${VLAUNCH_IMAGE:-vlaunch:latest}
models=${VLAUNCH_MODELS:-/srv/models}
gpus=()
if [[ -n ${GPUS:-} ]]; then
    gpus=(--gpus "$GPUS" -e VLAUNCH_DEVICE=cuda)
fi

caches() {
    # Owned by the containers' user, mode 0700: a plain volume (root, 0755) would be refused.
    docker volume create --driver local --opt type=tmpfs --opt device=tmpfs \
        --opt o=uid=1000,gid=1000,mode=0700 "$name-sockets" >/dev/null
    docker run -d --name "$name-cache" --user 1000:1000 "${gpus[@]}" \
        --stop-timeout 45 --restart on-failure:5 \
        -v "$name-sockets:/run/vlaunch" -v "$models:/models:ro" "$image" \
        vlaunch run --model /models/llama --tensor-parallel-size 2 \
            --socket-dir /run/vlaunch --health-port 8081
    # /readyz answers 200 once every cache rank serves its shard.
    until docker exec "$name-cache" python3 -c "import urllib.request; \
urllib.request.urlopen('http://127.0.0.1:8081/readyz', timeout=3)" 2>/dev/null; do
        if [[ $(docker inspect --format '{{.State.Status}}' "$name-cache") == exited ]]; then
            echo "the cache container exited; docker logs $name-cache says why" >&2
            exit 1
        fi
        sleep 2
    done
}

engine() {
    # Not started by vlaunch run: it sets the NVLink multicast variables itself.
    docker rm -f "$name-engine" >/dev/null 2>&1 || true
    docker run -d --name "$name-engine" --user 1000:1000 "${gpus[@]}" \
        --stop-timeout 30 --restart on-failure:5 -p "${VLAUNCH_PORT:-8000}:8000" \
        -e VLAUNCH_SOCKET_DIR=/run/vlaunch -e NCCL_NVLS_ENABLE=0 \
        -e TORCH_SYMM_MEM_DISABLE_MULTICAST=1 -e NVSHMEM_DISABLE_NVLS=1 \
        -v "$name-sockets:/run/vlaunch" -v "$models:/models:ro" "$image" \
        python3 -m vlaunch.cache.reference.engine --model /models/llama \
            --tensor-parallel-size 2 --no-fallback --timeout 600 --host 0.0.0.0 --port 8000
}

down() {
    docker rm -f "$name-engine" "$name-cache" >/dev/null 2>&1 || true
    docker volume rm "$name-sockets" >/dev/null 2>&1 || true
}

case ${1:-} in
    up) caches && engine ;;
    caches | engine | down) "$1" ;;
    *) echo "usage: $0 up|caches|engine|down" >&2; exit 2 ;;
esac
