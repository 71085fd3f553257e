#!/usr/bin/env bash
# The container suite on a clean CI machine: Docker from the distribution's packages, a base
# image built from Debian packages (no registry is reachable), the image of
# docs/examples/Dockerfile with the vlaunch wheel built from this checkout, then
# `pytest -m containers` against it. Any step that cannot run fails the run.
#
# Environment: VLAUNCH_CI_IMAGE (the image built, vlaunch-ci/vlaunch:latest), VLAUNCH_CI_BASE
# (vlaunch-ci/base:bookworm), PYTHON (the test venv's, .venv/bin/python), TORCH_SPEC
# (torch==2.13.0), TORCH_WHEELS (a directory whose CPU torch wheel goes into the build,
# /opt/wheels; none there: one from PyTorch's CPU index, else PyPI's default build).
set -euo pipefail
cd "$(dirname "$0")/.."
image=${VLAUNCH_CI_IMAGE:-vlaunch-ci/vlaunch:latest}
base=${VLAUNCH_CI_BASE:-vlaunch-ci/base:bookworm}
python=${PYTHON:-.venv/bin/python}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
started=$SECONDS

step() { echo "== containers: $* ($((SECONDS - started)) s)"; }

# 1. Packages, each keyed on its own binary (.ci/tools.sh): the daemon, its containerd and
# runc, the client, compose, the base image's builder, tini (docker run --init).
# shellcheck source=tools.sh
source .ci/tools.sh
need dockerd containerd runc docker docker-compose mmdebstrap tini

# 2. A daemon that answers (started here if none does; it starts its own containerd).
if ! docker info >/dev/null 2>&1; then
    step "starting dockerd"
    log=${DOCKERD_LOG:-/var/log/vlaunch-ci-dockerd.log}
    nohup dockerd >"$log" 2>&1 &
    for _ in $(seq 120); do
        docker info >/dev/null 2>&1 && break
        sleep 0.5
    done
    if ! docker info >/dev/null 2>&1; then
        echo "containers: dockerd did not answer within 60 s; its log ($log):" >&2
        tail -n 40 "$log" >&2
        exit 1
    fi
fi
# The legacy builder: docker.io 20.10 has no buildx, and newer clients need it for BuildKit.
export DOCKER_BUILDKIT=0

# 3. The base image, from distribution packages.
step "base image $base"
.ci/base-image.sh "$base"

# 4. The build context: vlaunch's wheel from this checkout, torch's CPU wheel when the machine
# has one, the host's CA bundle for pip (a TLS-intercepting proxy); none of it stays in the image.
context=build/containers
rm -rf "$context"
mkdir -p "$context/dist"
step "vlaunch wheel"
"$python" -m pip wheel -q --no-deps -w "$context/dist" .
build_args=(--build-arg "BASE=$base" --build-arg "TORCH=$torch_spec")
wheel=$(find "${TORCH_WHEELS:-/opt/wheels}" -maxdepth 1 -name 'torch-*+cpu-*.whl' 2>/dev/null \
        | sort | tail -n 1)
if [[ -n $wheel ]]; then
    cp "$wheel" "$context/dist/"
elif ! "$python" -m pip download -q --no-deps --only-binary :all: --timeout 30 --retries 1 \
        -d "$context/dist" \
        --index-url https://download.pytorch.org/whl/cpu "$torch_spec"; then
    echo "containers: no CPU torch wheel (none in ${TORCH_WHEELS:-/opt/wheels}, and" \
        "download.pytorch.org did not serve one): the image gets PyPI's default torch," \
        "with its CUDA libraries (a few GB more)" >&2
fi
cert=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
if [[ -f $cert ]]; then
    cp "$cert" "$context/dist/ca-bundle.crt"
    build_args+=(--build-arg "PIP_CERT=/dist/ca-bundle.crt")
fi

# 5. The image of the docs' Dockerfile.
step "image $image from docs/examples/Dockerfile"
docker build -f docs/examples/Dockerfile "${build_args[@]}" -t "$image" "$context"
echo "image $image: $(docker image inspect --format '{{.Size}}' "$image" \
    | awk '{printf "%.0f MB", $1/1e6}')"

# 6. The suite, against that image.
step "pytest -m containers"
VLAUNCH_TEST_IMAGE=$image "$python" -m pytest -m containers -n 0 -p no:cacheprovider \
    tests/containers
step "done"
