#!/usr/bin/env bash
# The host tools CI needs, each installed from Debian's packages when ITS OWN binary is missing.
# A machine may ship one binary of a family and not the rest (this kind ships the docker
# client at /usr/local/bin/docker and no daemon), so nothing is keyed on a sibling binary.
#
#     .ci/tools.sh install [BINARY ...]   install the packages of the missing binaries (all: none given)
#     .ci/tools.sh show [BINARY ...]      print each binary's path and version
#     source .ci/tools.sh; need BINARY ...  (from another CI script)
set -euo pipefail
# dockerd, runc and ip live in sbin, which a non-login root shell may not have on PATH.
case ":$PATH:" in *:/usr/sbin:*) ;; *) export PATH=$PATH:/usr/sbin:/sbin ;; esac

# binary -> the Debian package that ships it.
declare -A CI_PACKAGE=(
    [dockerd]=docker.io [docker]=docker.io [containerd]=containerd [runc]=runc
    [docker-compose]=docker-compose [mmdebstrap]=mmdebstrap [tini]=tini
    [systemd-analyze]=systemd [ip]=iproute2
)
CI_TOOLS=(dockerd docker containerd runc docker-compose mmdebstrap tini systemd-analyze ip)

# need BINARY...: install the packages of those that are missing (one apt-get run), then fail
# naming any binary still missing.
need() {
    local tool packages=()
    for tool in "$@"; do
        command -v "$tool" >/dev/null || packages+=("${CI_PACKAGE[$tool]:?no package known for $tool}")
    done
    if ((${#packages[@]})); then
        echo "ci tools: installing ${packages[*]} (for $*)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            $(printf '%s\n' "${packages[@]}" | sort -u)
    fi
    for tool in "$@"; do
        command -v "$tool" >/dev/null \
            || { echo "ci tools: $tool is still missing after apt-get install ${CI_PACKAGE[$tool]}" >&2; return 1; }
    done
}

# show BINARY...: one line each, path and version.
show() {
    local tool path version
    for tool in "$@"; do
        if path=$(command -v "$tool"); then
            case $tool in
                ip) version=$(ip -V 2>&1) ;;
                mmdebstrap) version=$(mmdebstrap --version 2>&1) ;;
                *) version=$("$tool" --version 2>&1) ;;
            esac
            printf '%-16s %-32s %s\n' "$tool" "$path" "$(head -n 1 <<<"$version")"
        else
            printf '%-16s %-32s %s\n' "$tool" "-" "missing"
        fi
    done
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    verb=${1:-show}
    shift || true
    (($#)) || set -- "${CI_TOOLS[@]}"
    case $verb in
        install) need "$@" ;;
        show) show "$@" ;;
        *) echo "usage: $0 install|show [BINARY ...]" >&2; exit 2 ;;
    esac
fi
