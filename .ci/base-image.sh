#!/usr/bin/env bash
# A Debian base image built from distribution packages, for hosts that reach no image registry:
#
#     .ci/base-image.sh TAG [EXTRA_PACKAGE ...]
#
# mmdebstrap builds a minbase root (python3, python3-venv, ca-certificates, tini and the extra
# packages) and `docker import` turns it into the image TAG. The image carries a label with
# the suite and the package list: an image of TAG built from the same list is kept, any other
# is rebuilt (BASE_IMAGE_REBUILD=1 rebuilds anyway). Environment: BASE_SUITE (bookworm),
# BASE_MIRROR (deb.debian.org), DOCKER (docker). Needs root, mmdebstrap and a Docker daemon.
set -euo pipefail

if [[ $# -lt 1 || $1 == -* ]]; then
    echo "usage: $0 TAG [EXTRA_PACKAGE ...]" >&2
    exit 2
fi
tag=$1
shift
suite=${BASE_SUITE:-bookworm}
mirror=${BASE_MIRROR:-http://deb.debian.org/debian}
docker=${DOCKER:-docker}
packages=$(printf '%s\n' python3 python3-venv ca-certificates tini "$@" | sort -u | paste -sd, -)
label="$suite $packages"

if [[ ${BASE_IMAGE_REBUILD:-0} != 1 ]] \
    && [[ $("$docker" image inspect --format '{{index .Config.Labels "vlaunch.base"}}' "$tag" \
            2>/dev/null) == "$label" ]]; then
    echo "base image $tag is up to date ($label)"
    exit 0
fi
for tool in mmdebstrap "$docker"; do
    if ! command -v "$tool" >/dev/null; then
        echo "base image: $tool is not installed (apt-get install mmdebstrap docker.io)" >&2
        exit 1
    fi
done

started=$SECONDS
# Documentation, manual pages and translations are left out: they are a fifth of the root.
# Security updates come from their own archive on a released suite (none for sid/testing).
sources=("deb $mirror $suite main")
if [[ $suite != sid && $suite != unstable && $suite != testing ]]; then
    sources+=("deb $mirror $suite-updates main"
              "deb ${BASE_SECURITY_MIRROR:-http://deb.debian.org/debian-security} $suite-security main")
fi
# Imported untagged, tagged only once mmdebstrap succeeded: a root cut short never gets TAG.
if ! image=$(mmdebstrap --variant=minbase --include="$packages" --format=tar \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/info/*' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        "$suite" - "${sources[@]}" \
        | "$docker" import \
            --change "LABEL vlaunch.base=\"$label\"" \
            --change 'ENV LANG=C.UTF-8' \
            --change 'CMD ["/bin/bash"]' \
            -); then
    [[ -n ${image:-} ]] && "$docker" image rm "$image" >/dev/null 2>&1
    echo "base image: mmdebstrap or docker import failed (their errors are above):" \
        "is $mirror reachable?" >&2
    exit 1
fi
"$docker" tag "$image" "$tag"
echo "base image $tag built in $((SECONDS - started)) s ($label):" \
    "$("$docker" image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}')"
