#!/usr/bin/env bash
# Runs INSIDE the base image (from .ci/systemd.sh, which commits the result): installs vlaunch
# from the wheel built from the checkout, as docs/systemd.md's Install section does, with the
# units the checkout ships. /src is the checkout (read-only), /wheels the wheel and torch.
set -euo pipefail
# Set here, not with `docker run -e`: `docker commit` would keep them in the image.
export PIP_CERT=/etc/ssl/certs/host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1
python3 -m venv /opt/vlaunch
# torch==2.13.0 from /wheels where the CPU wheel was copied there; the rest from PyPI
# (PIP_CERT: the host's CA bundle, which .ci/systemd.sh mounts there).
/opt/vlaunch/bin/pip install -q --find-links /wheels 'torch==2.13.0' \
    "$(ls /wheels/vlaunch-*.whl)"
/opt/vlaunch/bin/vlaunch --help >/dev/null
useradd --system --home-dir /var/lib/vlaunch --create-home vlaunch
install -m 0644 /src/units/vlaunch@.service /src/units/vlaunch@.socket \
    /src/units/vlaunch-cache@.service \
    /src/docs/examples/vlaunch-engine@.service /etc/systemd/system/
install -d -m 0755 /etc/vlaunch /models
# A container has no network to wait for, no getty and no udev to settle.
systemctl mask getty@tty1.service console-getty.service systemd-udevd.service \
    systemd-udev-trigger.service systemd-networkd-wait-online.service >/dev/null 2>&1 || true
systemctl set-default multi-user.target >/dev/null
rm -rf /root/.cache /var/cache/apt/archives/*.deb
