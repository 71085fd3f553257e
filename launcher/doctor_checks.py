"""`vlaunch doctor`'s checks: each reads one host setting and says what it found, what vlaunch
will do because of it, and the fix.

A blocker breaks a deployment (`vlaunch run` would exit, or a rank could not serve); a
warning changes behaviour (slower handoffs, fewer guarantees). The host's files are read under
`Host.root` and the cache-side results come from `Host.probe` (vlaunch.cache.rank.hostprobe),
so that tests fake a host by its files and its probe answers.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OK, WARNING, BLOCKER, SKIPPED = "ok", "warning", "blocker", "skipped"
THP = "sys/kernel/mm/transparent_hugepage/shmem_enabled"
GiB = 1 << 30


@dataclass(frozen=True)
class Finding:
    """One check's outcome."""

    check: str
    severity: str
    found: str
    choice: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Host:
    """Where the checks look: the filesystem root, the cache-side probe's answers, NVML's
    devices (None: no NVML) and persistence modes, and the docker command's runner."""

    root: Path
    probe: dict[str, Any]
    gpus: list[Any] | None = None
    persistence: dict[str, bool] = field(default_factory=dict)
    nvml_error: str = ""
    docker: Callable[[], tuple[int, str]] | None = None

    def read(self, rel: str) -> str | None:
        try:
            return (self.root / rel).read_text()
        except OSError:
            return None


def slab_pages(host: Host, device: str) -> Finding:
    """The page size of CPU slabs (the rank's own probe) against the shmem THP policy."""
    raw = host.read(THP)
    policy = next((w.strip("[]") for w in (raw or "").split() if w.startswith("[")), "unknown")
    got = host.probe["slab_pages"]
    data = {"shmem_enabled": policy, "requested": got["requested"], "page": got["page"]}
    found = f"shmem_enabled {policy}, VLAUNCH_CPU_SLAB_PAGES={got['requested'] or '?'}"
    if got["error"]:
        return Finding("slab_pages", BLOCKER, found, f"cache ranks exit 64: {got['error']}",
                       "fix or unset VLAUNCH_CPU_SLAB_PAGES / VLAUNCH_CPU_SLABS", data)
    choice = f"CPU slabs get {'2 MiB' if got['page'] == '2M' else '4 KiB'} pages"
    if got["page"] == "2M" or got["requested"] == "4k":
        return Finding("slab_pages", OK, found, choice, "", data)
    if device != "cpu":
        return Finding("slab_pages", OK, found, choice + " (unused: CUDA slabs are device "
                       "memory)", "", data)
    return Finding("slab_pages", WARNING, found,
                   choice + ": a CPU share handoff faults 512 times as many pages (slower)",
                   "as root: echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled "
                   "(or within_size; not kept across reboots: set it in a tmpfiles.d or boot "
                   "unit)", data)


def memfd_seals(host: Host, device: str) -> Finding:
    """A slab memfd made and sealed as a rank does it."""
    got = host.probe["memfd"]
    if not got["created"]:
        sev = BLOCKER if device == "cpu" else WARNING
        return Finding("memfd_seals", sev, f"memfd_create or F_ADD_SEALS fails: {got['error']}",
                       "CPU cache ranks cannot make slabs", "a Linux kernel with memfd sealing "
                       "(3.17+) and no seccomp profile that forbids memfd_create", got)
    if not got["sealed"]:
        return Finding("memfd_seals", WARNING, "F_SEAL_FUTURE_WRITE is refused",
                       "CPU slabs are sealed against resizing only: a share-mode engine that "
                       "maps a slab writable could change the cache's weights",
                       "Linux 5.1 or later", got)
    return Finding("memfd_seals", OK, "memfd_create and F_ADD_SEALS (future writes) work",
                   "CPU slabs are sealed read-only after their fill", "", got)


def nofile(host: Host) -> Finding:
    """RLIMIT_NOFILE as the rank raises it, against its connection bound."""
    got = host.probe["nofile"]
    found = f"RLIMIT_NOFILE soft {got['soft_before']}, hard {got['hard']}"
    if got["error"]:
        return Finding("nofile", BLOCKER, found, f"cache ranks exit 64: {got['error']}",
                       "fix VLAUNCH_MAX_CONNECTIONS", got)
    soft = got["soft"]
    room = None if soft < 0 else soft - got["reserve"]
    choice = f"each rank raises it to {'unlimited' if soft < 0 else soft} and keeps at " \
             f"most {got['bound']} client connections"
    if got["given"] is not None and room is not None and got["given"] > room:
        return Finding("nofile", WARNING, found + f", VLAUNCH_MAX_CONNECTIONS={got['given']}",
                       choice + f", more than the {room} fds left: a rank can run out of fds, "
                       "shed idle clients, and exit 72 after 30 s without an accept",
                       "raise LimitNOFILE= / ulimit -n (docker --ulimit nofile=) or lower "
                       "VLAUNCH_MAX_CONNECTIONS", got)
    if got["bound"] < got["default"]:
        return Finding("nofile", WARNING, found, choice + f" (fewer than the default "
                       f"{got['default']}: the hard limit is low)",
                       f"raise the hard limit to at least {got['default'] + got['reserve']} "
                       "(LimitNOFILE=, ulimit -Hn, docker --ulimit nofile=)", got)
    return Finding("nofile", OK, found, choice, "", got)


def cgroup(host: Host, own: Callable[[str, str], Path | None]) -> Finding:
    """Whether the launcher's children get a delegated cgroup v2 of their own (children.py)."""
    base = own(str(host.root / "proc/self/mountinfo"), str(host.root / "proc/self/cgroup"))
    fallback = ("children tracked by process group and the parent-death signal: what an "
                "engine daemonizes can outlive a launcher killed with SIGKILL")
    fix = ("systemd: Delegate=yes in the unit (units/ ship it); Docker: a private cgroup "
           "namespace (--cgroupns=private, the default on cgroup v2)")
    if base is None:
        return Finding("cgroup", WARNING, "no cgroup v2 of this process's own (cgroup v1, or "
                       "the hierarchy's root)", fallback, fix)
    writable = os.access(base, os.W_OK) and os.access(base / "cgroup.procs", os.W_OK) \
        and (base / "cgroup.kill").exists()
    if not writable:
        return Finding("cgroup", WARNING, f"cgroup {base} is not delegated (not writable, or "
                       "no cgroup.kill: Linux 5.14+)", fallback, fix, {"cgroup": str(base)})
    return Finding("cgroup", OK, f"cgroup {base} is delegated",
                   "children run in a child cgroup that cgroup.kill empties on every stop", "",
                   {"cgroup": str(base)})


def proc(host: Host, ours: bool) -> Finding:
    """The /proc mount: this PID namespace's (else vlaunch run exits 64), and hidepid."""
    opts = ""
    for line in (host.read("proc/self/mounts") or "").splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[1] == "/proc" and parts[2] == "proc":
            opts = parts[3]
    hide = next((o.split("=", 1)[1] for o in opts.split(",") if o.startswith("hidepid=")), "0")
    data = {"hidepid": hide, "ours": ours}
    if not ours:
        return Finding("proc", BLOCKER, "/proc is another PID namespace's than this process's",
                       "vlaunch run refuses to start (64): its final sweep would kill "
                       "processes that are not its own",
                       "mount a /proc for this PID namespace (unshare --pid --fork "
                       "--mount-proc; container runtimes do)", data)
    if hide not in ("0", "off"):
        return Finding("proc", WARNING, f"/proc is mounted hidepid={hide}",
                       "processes of other users are invisible: run the launcher, the ranks "
                       "and the engine as one user (a standby engine opens its promote pipe "
                       "through /proc)", "mount /proc without hidepid, or keep one user", data)
    return Finding("proc", OK, "/proc is this PID namespace's, no hidepid",
                   "the launcher sweeps its children's descendants through /proc", "", data)


def socket_dir(directory: Path, longest: Callable[[Path], Path]) -> Finding:
    """The socket directory as vlaunch run would take it: ours, 0700, short enough paths."""
    from vlaunch.cache.contract.errors import SocketDirError
    from vlaunch.cache.contract.sockdir import MAX_SUN_PATH, ensure_socket_dir

    data: dict[str, Any] = {"path": str(directory), "max": MAX_SUN_PATH}
    fix_dir = "pass --socket-dir (VLAUNCH_SOCKET_DIR) a directory of your own, mode 0700"
    try:
        data["longest"] = len(os.fsencode(longest(directory)))
    except SocketDirError as exc:
        return Finding("socket_dir", BLOCKER, str(exc), "vlaunch run exits 73",
                       "a shorter --socket-dir", data)
    if not os.path.lexists(directory):
        parent = directory.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not os.access(parent, os.W_OK | os.X_OK):
            return Finding("socket_dir", BLOCKER, f"socket directory {directory} does not "
                           f"exist and {parent} is not writable", "vlaunch run exits 73", fix_dir,
                           data)
        return Finding("socket_dir", OK, f"{directory} does not exist yet",
                       "vlaunch run creates it, mode 0700, and removes it at exit", "", data)
    try:
        ensure_socket_dir(directory, create=False)
    except SocketDirError as exc:
        st = os.lstat(directory)
        data.update(uid=st.st_uid, mode=f"{stat.S_IMODE(st.st_mode):04o}")
        return Finding("socket_dir", BLOCKER, str(exc), "vlaunch run exits 73", fix_dir, data)
    holder = _lock_holder(directory / "launcher.lock")
    if holder:
        return Finding("socket_dir", WARNING, f"a launcher (pid {holder}) uses {directory} now",
                       "a second vlaunch run on it exits 75", "stop it, or use another "
                       "--socket-dir", data)
    return Finding("socket_dir", OK, f"{directory} is ours, mode 0700",
                   "rank sockets are made there, mode 0600", "", data)


def _lock_holder(path: Path) -> str:
    """The pid written in a launcher lock that someone holds, else ""."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    return ""


def listen(values: tuple[str, ...], try_bind: Callable[[str], str]) -> Finding:
    """Each --listen address as vlaunch run would bind it (`try_bind`: "" when it can, else
    the error vlaunch run would exit 64 with, which names the fix)."""
    if not values:
        return Finding("listen", SKIPPED, "no --listen given",
                       "the engine binds its own port (nothing queues across its restarts)")
    problems = [problem for value in values if (problem := try_bind(value))]
    data: dict[str, Any] = {"addresses": list(values), "problems": problems}
    if problems:
        return Finding("listen", BLOCKER, "; ".join(problems),
                       "vlaunch run exits 64 before any rank starts",
                       "each message's own fix (another address, or stop what holds it)", data)
    return Finding("listen", OK, f"{', '.join(values)}: free, and this user may bind it",
                   "the launcher binds it once and hands it to every engine", "", data)
