"""The processes that opened a rank's raw layout, and whether any of them may still map it.

A lease can end with its tensors kept (`CacheClient.close()`), so an ended connection proves
nothing: only the opener's exit does. An opener this process can name (its pid, and /proc of
this PID namespace) is followed by pid and start time, which holds nothing open. One it cannot
(pid 0: another PID namespace) is followed by a pidfd of its socket (SO_PEERPIDFD, Linux 6.5),
one fd each, which the event loop watches: it is closed the moment that process exits. With
neither (another PID namespace on an older kernel) the openers are unknown for the rank's life:
a copy-release engine then gets a copy, never the slabs themselves.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass

from vlaunch.cache.contract import peers

log = logging.getLogger("vlaunch.cache")

PRUNE_AT = 64
"""Openers noted before the exited ones are forgotten."""
MAX_OPENERS = 256
"""Live openers followed at most; past that the rank stops following them (and closes their
pidfds): from then on one may always be alive."""


@dataclass(eq=False)
class _Opener:
    pid: int
    pidfd: int = -1
    started: float = 0.0

    def alive(self) -> bool:
        if self.pidfd >= 0:
            return not peers.pidfd_exited(self.pidfd)
        return start_time(self.pid) == self.started

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


class Openers:
    """Who opened one rank's raw layout; `unknown` names why the rank cannot tell any more."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._openers: list[_Opener] = []
        self._by_pid: dict[int, _Opener] = {}  # the latest opener of each known pid
        self._proc_ours = peers.proc_is_ours()  # /proc names the pids SO_PEERCRED gives
        self.unknown = ""
        # whether a successor (a respawn that adopts the slabs) could be told every opener
        # by pid and start time: not when one was in another PID namespace, or after give_up
        self.incomplete = False
        self.incomplete_told = False  # the launcher knows
        self.news: list[tuple[int, float]] = []  # openers by pid the launcher was not told of

    def __len__(self) -> int:
        return len(self._openers)

    def note(self, conn: socket.socket, pid: int) -> bool:
        """Follow the process behind `conn` (`pid`: what SO_PEERCRED gave); False when that
        takes its start time from /proc, for `note_by_pid` to read off the reply's path."""
        if self.unknown:
            return True
        if pid != peers.UNKNOWN_PID and self._proc_ours:
            return False
        self.incomplete = True  # followed by a pidfd, if at all: no successor can name it
        try:
            pidfd = peers.peer_pidfd(conn)
        except peers.PeerGone:
            return True  # it exited already, and its mappings with it
        if pidfd is None:
            self.give_up("a process in another PID namespace opened them, and this kernel "
                         "gives no pidfd of a socket's peer (SO_PEERPIDFD: Linux 6.5)")
            return True
        known = self._by_pid.get(pid)
        if known is not None and known.pidfd >= 0 and known.alive():
            os.close(pidfd)  # a live pid names one process: followed already
            return True
        self._add(_Opener(pid, pidfd))
        return True

    def to_tell(self, everything: bool = False) -> tuple[list[tuple[int, float]], bool]:
        """What the launcher is to hear, once: the openers by pid (start time) it was not told
        of (`everything`: all of them), and whether to say that not every opener can be named."""
        news = self.listed() if everything else self.news
        self.news = []
        incomplete = self.incomplete and (everything or not self.incomplete_told)
        if incomplete:
            self.incomplete_told = True
        return news, incomplete

    def note_by_pid(self, pid: int) -> None:
        """Follow `pid` by its start time (a pid and its start time name one process)."""
        if self.unknown:
            return
        known = self._by_pid.get(pid)
        if known is not None and known.alive():
            return
        started = start_time(pid)
        if started:  # 0.0: it exited before this ran, and its mappings with it
            self._add(_Opener(pid, started=started))

    def alive(self) -> bool:
        """Whether an opener may still map the slabs (forgets the ones that exited)."""
        if self.unknown:
            return True
        self._prune()
        return bool(self._openers)

    def describe(self, leased: frozenset[int] = frozenset()) -> str:
        """The openers that may still map the slabs, by pid (those in `leased`, which hold a
        lease now, left out), in words; "" when none is left."""
        self._prune()
        names = sorted({peers.describe(o.pid) for o in self._openers if o.pid not in leased})
        if not names:
            return ""
        more = f" and {len(names) - 4} more" if len(names) > 4 else ""
        if len(names) == 1:
            return (f"{names[0]}, which opened them before and still runs (its lease ended; "
                    "its tensors may not have)")
        return (f"{', '.join(names[:4])}{more}, which opened them before and still run (their "
                "leases ended; their tensors may not have)")

    def adopt(self, fds: list[int], backend: str, *, opened: list[tuple[int, float]],
              incomplete: bool) -> None:
        """Slabs adopted from a rank that exited: follow every process that may map them
        now. `opened`: the openers that rank named to the launcher (pid, start time), still
        the same processes; on a CPU, also whoever maps them now (a memfd's mappers have a
        line of /proc/PID/maps with its inode). `incomplete`: that rank could not name every
        opener (one in another PID namespace, or too many): unknown for good."""
        if incomplete:
            self.give_up("it adopted its slabs from a rank that exited, which could not name "
                         "every process that opened them (one in another PID namespace, or "
                         f"more than {MAX_OPENERS})")
            return
        if not self._proc_ours:
            self.give_up("it adopted its slabs from a rank that exited, and /proc here is not "
                         "of its PID namespace: the processes that opened them cannot be "
                         "followed")
            return
        for pid, started in opened:
            if start_time(pid) == started and pid not in self._by_pid:
                self._add(_Opener(pid, started=started))
        if backend == "cpu":
            for pid in mapping_pids(fds):
                self.note_by_pid(pid)
        log.info("rank %d: adopted slabs that %d process(es) may still map: %s", self.rank,
                 len(self._openers), ", ".join(str(o.pid) for o in self._openers) or "none")

    def listed(self) -> list[tuple[int, float]]:
        """The live openers a successor can follow: (pid, start time) each."""
        self._prune()
        return [(o.pid, o.started) for o in self._openers if o.pidfd < 0 and o.started]

    def give_up(self, why: str) -> None:
        """Stop following openers: from now on one may always be alive."""
        if not self.unknown:
            log.info("rank %d: copy-release engines get a copy from now on, never the slabs "
                     "themselves: %s", self.rank, why)
        self.unknown, self.incomplete = why, True
        self.close()

    def close(self) -> None:
        """Close every pidfd held."""
        for opener in self._openers:
            self._close(opener)
        self._openers, self._by_pid = [], {}

    def _add(self, opener: _Opener) -> None:
        self._openers.append(opener)
        if opener.pid != peers.UNKNOWN_PID:
            self._by_pid[opener.pid] = opener
        if opener.pidfd < 0 and opener.started:
            self.news.append((opener.pid, opener.started))
        if opener.pidfd >= 0:  # readable once the process has exited
            asyncio.get_running_loop().add_reader(opener.pidfd, self._exited, opener)
        if len(self._openers) > PRUNE_AT:
            self._prune()
        if len(self._openers) > MAX_OPENERS:
            self.give_up(f"more than {MAX_OPENERS} processes that opened its slabs still run")

    def _prune(self) -> None:
        kept = []
        for opener in self._openers:
            if opener.alive():
                kept.append(opener)
                continue
            self._forget(opener)
        self._openers = kept

    def _exited(self, opener: _Opener) -> None:
        """An opener's pidfd polled readable: it has exited, and its mappings with it."""
        if opener in self._openers:
            self._openers.remove(opener)
        self._forget(opener)

    def _forget(self, opener: _Opener) -> None:
        self._close(opener)
        if self._by_pid.get(opener.pid) is opener:
            del self._by_pid[opener.pid]

    @staticmethod
    def _close(opener: _Opener) -> None:
        if opener.pidfd >= 0:
            asyncio.get_running_loop().remove_reader(opener.pidfd)
        opener.close()


def start_time(pid: int) -> float:
    """When process `pid` started (0.0 when there is none): a pid and its start time name one
    process, whatever reuses the pid later."""
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return 0.0


def mapping_pids(fds: list[int]) -> list[int]:
    """The processes of this user, this one aside, that map any of the files `fds` are open on
    (memfds), by their /proc/PID/maps; a process that exits meanwhile maps nothing."""
    wanted = set()
    for fd in fds:
        st = os.fstat(fd)
        wanted.add((f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", str(st.st_ino)))
    me, uid, out = os.getpid(), os.getuid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/maps", "rb") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) > 4 and parts[4] != b"0" and \
                            (parts[3].decode(), parts[4].decode()) in wanted:
                        out.append(int(name))
                        break
        except OSError:  # it exited, or is not ours to read
            continue
    return out
