"""A machine with systemd as PID 1 for tests/test_systemd.py: a Docker container of the image
that .ci/systemd.sh builds (its own root filesystem; never this machine's), driven through
`docker exec` with systemctl, journalctl and `vlaunch status`."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")

BOOTED = ("running", "degraded")
"""What `systemctl is-system-running --wait` answers once the boot has finished."""


def cgroup_args() -> list[str]:
    """The `docker run` options under which systemd can run its cgroup tree on this host.

    cgroup v1 (a hybrid host, Docker's cgroupfs driver): the host's /sys/fs/cgroup bound
    read-only; systemd finds its own subtree (/docker/ID) writable in each hierarchy under it,
    which is what systemd's own container support expects. cgroup v2: the host's cgroup
    namespace and a writable /sys/fs/cgroup, since Docker 20.10 mounts a private one read-only.
    """
    version = subprocess.run(["docker", "info", "--format", "{{.CgroupVersion}}"],
                             capture_output=True, text=True, check=True).stdout.strip()
    if version == "2":
        return ["--cgroupns=host", "-v", "/sys/fs/cgroup:/sys/fs/cgroup:rw"]
    return ["-v", "/sys/fs/cgroup:/sys/fs/cgroup:ro"]


class Machine:
    """One booted container; `sh` runs a command in it as root."""

    def __init__(self, image: str, name: str, mounts: Mapping[str, str] | None = None) -> None:
        self.name = name
        binds = [a for host, there in (mounts or {}).items() for a in ("-v", f"{host}:{there}")]
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
        # /run, /run/lock and /tmp as tmpfs, as systemd expects of a container; SIGRTMIN+3 is
        # systemd's "halt" for `docker stop`; a /dev/shm of 1 GiB, not Docker's 64 MiB (vLLM's
        # CPU engine asks for 160 MiB of it).
        subprocess.run(["docker", "run", "-d", "--name", name, "--hostname", name,
                        "--tmpfs", "/run", "--tmpfs", "/run/lock", "--tmpfs", "/tmp",
                        "--shm-size", "1g",
                        "--stop-signal", "SIGRTMIN+3", *cgroup_args(), *binds, image,
                        "/lib/systemd/systemd"], check=True, capture_output=True, text=True)
        # until PID 1 listens on its private socket, systemctl cannot connect: ask again
        state = self.sh("for _ in $(seq 120); do s=$(systemctl is-system-running --wait); "
                        '[ -n "$s" ] && { echo "$s"; exit; }; sleep 1; done', check=False,
                        timeout=300)
        if state.stdout.strip() not in BOOTED:
            log = subprocess.run(["docker", "logs", name], capture_output=True, text=True)
            failed = self.sh("systemctl --failed --no-legend", check=False).stdout
            self.close()
            raise RuntimeError(f"systemd in {image} did not boot ({state.stdout.strip()!r}); "
                               f"failed units: {failed!r}; {state.stderr}"
                               f"{log.stdout[-2000:]}{log.stderr}")

    def sh(self, command: str, *, check: bool = True, timeout: float = 120,
           stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run `command` under bash in the container; raise with its output if it fails."""
        r = subprocess.run(["docker", "exec", *(["-i"] if stdin is not None else []),
                            self.name, "bash", "-c", command], input=stdin,
                           capture_output=True, text=True, timeout=timeout, check=False)
        if check and r.returncode:
            raise AssertionError(f"{command!r} exited {r.returncode}:\n{r.stdout}{r.stderr}")
        return r

    def write(self, path: str, text: str, mode: str = "0644") -> None:
        """Create `path` (and its directory) with `text`."""
        self.sh(f"mkdir -p $(dirname {shlex.quote(path)}) && cat > {shlex.quote(path)} && "
                f"chmod {mode} {shlex.quote(path)}", stdin=text)

    def systemctl(self, *args: str, check: bool = True,
                  timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """systemctl ARGS in the container."""
        return self.sh("systemctl " + shlex.join(args), check=check, timeout=timeout)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """`systemctl show` of these properties."""
        out = self.systemctl("show", unit, *(f"-p{p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait(self, check: Callable[[], T | None], timeout: float,
             what: str | Callable[[], str], interval: float = 0.2) -> T:
        """Poll `check` until it returns something truthy, or fail naming `what`."""
        deadline = time.monotonic() + timeout
        while True:
            got = check()
            if got:
                return got
            if time.monotonic() > deadline:
                said = what() if callable(what) else what
                raise AssertionError(f"not within {timeout:g} s: {said}")
            time.sleep(interval)

    def journal(self, unit: str) -> str:
        """The unit's journal, systemd's own lines about it included."""
        self.sh("journalctl --sync", check=False)
        return self.sh(f"journalctl --no-pager -o cat -u {shlex.quote(unit)}").stdout

    def status(self, instance: str) -> dict:
        """`vlaunch status --json` of the launcher whose socket directory is /run/vlaunch/NAME."""
        r = self.sh(f"VLAUNCH_SOCKET_DIR=/run/vlaunch/{instance} "
                    "runuser -u vlaunch -- /opt/vlaunch/bin/vlaunch status --json")
        return json.loads(r.stdout)

    def http(self, url: str, body: str | None = None, timeout: float = 60) -> tuple[int, str]:
        """GET `url` (POST `body`) from inside the container: (status, body); (0, the error)
        when nothing answers."""
        # Any transport error is no answer, a truncated body (IncompleteRead) included.
        code = ("import sys, http.client, urllib.request, urllib.error\n"
                "data = sys.argv[2].encode() if len(sys.argv) > 2 else None\n"
                "try:\n"
                f"    r = urllib.request.urlopen(sys.argv[1], data, timeout={timeout})\n"
                "    print(r.status); print(r.read().decode())\n"
                "except urllib.error.HTTPError as e:\n    print(e.code); print(e.read().decode())\n"
                "except (OSError, http.client.HTTPException) as e:\n    print(0); print(e)\n")
        extra = "" if body is None else " " + shlex.quote(body)
        r = self.sh(f"python3 -c {shlex.quote(code)} {shlex.quote(url)}{extra}",
                    timeout=timeout + 30)
        status, _, text = r.stdout.partition("\n")
        return int(status), text

    def close(self) -> None:
        """Remove the container (its systemd and everything it ran)."""
        subprocess.run(["docker", "rm", "-f", self.name], capture_output=True, check=False)


def image_or_fail() -> str:
    """The image .ci/systemd.sh built ($VLAUNCH_SYSTEMD_IMAGE); a test that has none fails."""
    image = os.environ.get("VLAUNCH_SYSTEMD_IMAGE", "")
    if not image:
        raise RuntimeError("VLAUNCH_SYSTEMD_IMAGE is not set: run these tests through "
                           ".ci/systemd.sh, which builds the image with systemd and vlaunch")
    return image
