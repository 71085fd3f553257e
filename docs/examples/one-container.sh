#!/usr/bin/env bash
# One container: `vlaunch run` starts the cache ranks and the engine (behind the image's tini)
# and restarts the engine against the caches; the launcher holds the engine's port (--listen), so
# the published port never refuses while engines change; docs/docker.md explains each option.
#   GPUS='"device=0,1"' ./one-container.sh
# GPUS: the GPUs the container gets (docker run --gpus); unset, the weights stay on the CPU.
# VLAUNCH_IMAGE, VLAUNCH_MODELS (the host directory that holds llama/), VLAUNCH_NAME,
# VLAUNCH_PORT: the image, the checkpoints, the container's name, the engine's host port.
set -euo pipefail
gpus=()
if [[ -n ${GPUS:-} ]]; then
    gpus=(--gpus "$GPUS" -e VLAUNCH_DEVICE=cuda)
fi
docker run -d --name "${VLAUNCH_NAME:-llama}" "${gpus[@]}" \
    --stop-timeout 45 --restart on-failure:5 \
    -v "${VLAUNCH_MODELS:-/srv/models}:/models:ro" -p "${VLAUNCH_PORT:-8000}:8000" \
    "${VLAUNCH_IMAGE:-vlaunch:latest}" \
    vlaunch run --model /models/llama --tensor-parallel-size 2 --listen 0.0.0.0:8000 \
        --engine-ready http --engine-health-url http://127.0.0.1:8000/health \
        --engine-liveness-request 'POST http://127.0.0.1:8000/generate {"tokens": [1], "max_new_tokens": 1}' -- \
    python3 -m vlaunch.cache.reference.engine --host 0.0.0.0 --port 8000
