"""The keeper: runs one engine command and takes everything it started down with it.

`vlaunch run` starts the engine, a standby and the preload command as
`python -m vlaunch.launcher.keeper COMMAND...`, in their own process group. The keeper

- is the child subreaper of what it starts: a worker whose parent died, a daemon that left the
  process group (setsid, a double fork) re-parent to the keeper, not to init;
- runs COMMAND as its only child, in the keeper's process group (the launcher signals that
  group, so the engine gets each signal first-hand; one that reaches the keeper alone is
  passed on to an engine that left the group), dying with the keeper (parent-death signal),
  with `WATCHDOG_PID` set to the engine's pid when `WATCHDOG_USEC` is set, and the sockets
  of `vlaunch run --listen` (named in PASS_ENV) placed at fds 3.. with `LISTEN_FDS`,
  `LISTEN_FDNAMES` and `LISTEN_PID` (the engine's own pid, as sd_listen_fds(3) checks);
- once COMMAND has exited, SIGKILLs every descendant left and exits with COMMAND's status (a
  death by signal is re-raised, so the launcher sees the same status as without a keeper);
- when the launcher dies, even by SIGKILL (its parent-death signal, SIGTERM, arrives with the
  keeper's parent changed), SIGKILLs COMMAND and every descendant, then exits.

Without a delegated cgroup (children.py) this is what ends an engine's workers and daemons
after the launcher's SIGKILL. What it cannot cover: the keeper itself SIGKILLed (the engine
dies with it; a daemon of the engine re-parents to the launcher, a subreaper too, whose final
sweep kills it). It imports the standard library, vlaunch's lifetime helpers and, at
teardown only, psutil: nothing that would slow an engine's start.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import signal
import sys
import time
from types import FrameType

from vlaunch.cache.contract import settings
from vlaunch.cache.contract.lifetime import become_subreaper, die_with_parent

PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
"""Signals the keeper handles: passed on to an engine outside its group, else left to it."""
COMMAND_SIGTERM = signal.SIGRTMIN + 1
"""Sent to the keeper alone: SIGTERM to the command alone, not to its workers (a planned stop:
the command drains what it holds, then stops its workers itself; children.signal_command)."""
HANDLED = (*PASSED_ON, COMMAND_SIGTERM)
TEARDOWN_ROUNDS = 50
PASS_ENV = "VLAUNCH_LISTEN_PASS"
"""The keeper's fd numbers of the engine's listening sockets, comma-separated (launcher)."""
NAMES_ENV = "VLAUNCH_LISTEN_NAMES"
"""Their names, ':'-separated: the engine's LISTEN_FDNAMES."""
PROMOTE_ENV = "VLAUNCH_PROMOTE_FD"  # cache/contract/standby.py's: moved clear of fds 3..


class Keeper:
    """The engine's parent: starts it, passes signals on, reaps, kills what is left."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.parent = os.getppid()
        self.child = 0
        self.early: set[int] = set()  # signals that came before the command was started

    def run(self) -> int:
        """Start the command, wait for it, clean up; returns its raw status (waitstatus)."""
        become_subreaper()
        for sig in PASSED_ON:
            signal.signal(sig, self._on_signal)
        signal.signal(COMMAND_SIGTERM, self._on_command_sigterm)
        with contextlib.suppress(OSError):  # the launcher's death: see _on_signal
            die_with_parent(signal.SIGTERM)
        if os.getppid() != self.parent:  # it died before the prctl took effect
            return 1 << 8
        self.child = self._start()
        status = self._wait()
        self._kill_descendants()
        return status  # a waitstatus

    def _start(self) -> int:
        """Fork and exec the command (in the child: die with the keeper, default signals).

        A signal the launcher sent the group before the command existed (a stop that began
        while a standby starts) reached the keeper alone: the command gets it once started,
        or it would run on, unstopped, until the stop timeout. Signals are blocked around the
        fork, so that each one is either such an early one or reaches the command itself (a
        pending COMMAND_SIGTERM is handled once unblocked, with the command started)."""
        signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
        early = self.early | (signal.sigpending() & set(PASSED_ON))
        pid = os.fork()
        if pid:
            self.child = pid
            for sig in sorted(early):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)
            os.closerange(3, _max_fd())  # a standby's promote fd is the engine's alone
            return pid
        try:
            die_with_parent()
            for sig in HANDLED:
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)
            env = dict(os.environ)
            if "WATCHDOG_USEC" in env:
                env["WATCHDOG_PID"] = str(os.getpid())
            place_listen_fds(env)
            os.execvpe(self.argv[0], self.argv, env)
        except OSError as exc:
            sys.stderr.write(f"vlaunch keeper: cannot start {self.argv[0]}: {exc.strerror}; "
                             "check the command and PATH\n")
            os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
        os._exit(126)

    def _wait(self) -> int:
        """Reap children (orphans included) until the command itself has exited."""
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                return 1 << 8
            if pid == self.child:
                return status

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The launcher is gone: tear everything down. Else pass the signal on to an engine
        that left our process group (the launcher's group signal missed it)."""
        if os.getppid() != self.parent:
            self._kill_descendants()
            os._exit(128 + signal.SIGKILL)
        if not self.child:
            self.early.add(signum)  # passed on once the command runs (_start)
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(self.child)
            if group != os.getpgrp():
                os.killpg(group, signum)

    def _on_command_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """SIGTERM to the command alone (or once it runs)."""
        if os.getppid() != self.parent:
            self._on_signal(signum, frame)  # the launcher is gone: tear down
        elif not self.child:
            self.early.add(signal.SIGTERM)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child, signal.SIGTERM)

    def _kill_descendants(self) -> None:
        """SIGKILL every descendant until none is left (what a killed process had started
        meanwhile re-parents to us and is found in the next round); reap them all."""
        _reap_all()
        if not _has_children():  # the usual end: nothing left (a subreaper's descendants
            return  # are its children once their parents are gone)
        import psutil

        def running(proc: psutil.Process) -> bool:
            try:
                return proc.status() != psutil.STATUS_ZOMBIE
            except psutil.Error:
                return False

        me = psutil.Process()
        for _ in range(TEARDOWN_ROUNDS):
            left = [p for p in me.children(recursive=True) if running(p)]
            if not left:
                break
            for proc in left:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            psutil.wait_procs(left, timeout=1)
            _reap_all()
            time.sleep(0.01)
        _reap_all()


def place_listen_fds(env: dict[str, str]) -> None:
    """In the engine, just before its exec: the passed listening sockets at fds 3, 4, ...
    (inheritable), the socket-activation variables naming this process, every other copy of
    them closed; a standby's promote fd in that range is moved above it (env says where)."""
    raw, names = settings.get(PASS_ENV, env), settings.get(NAMES_ENV, env)
    for name in (PASS_ENV, NAMES_ENV):
        env.pop(name, None)
    if not raw:
        return
    fds = [int(fd) for fd in raw.split(",")]
    first, end = 3, 3 + len(fds)
    promote = settings.get(PROMOTE_ENV, env)
    if promote.isdigit() and first <= int(promote) < end:
        env[PROMOTE_ENV] = str(fcntl.fcntl(int(promote), fcntl.F_DUPFD, end))
        os.close(int(promote))
    # copies above the range first (close-on-exec), so that no dup2 overwrites a socket
    # still to be placed
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, end) for fd in fds]
    for fd in fds:
        if not first <= fd < end:
            os.close(fd)
    for i, fd in enumerate(high):
        os.dup2(fd, first + i)  # inheritable
        os.close(fd)
    env.update({"LISTEN_FDS": str(len(fds)), "LISTEN_PID": str(os.getpid()),
                "LISTEN_FDNAMES": names})


def _has_children() -> bool:
    """Whether any child process (running or not yet reaped) is left."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def _reap_all() -> None:
    """Collect every exited child."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return


def _max_fd() -> int:
    """One past the highest fd number this process may have."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if 0 < soft < 1 << 20 else 1 << 16


def exit_as(status: int) -> None:
    """Exit as the command did: its code, or the signal that killed it (no core dump)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        with contextlib.suppress(ValueError, OSError):  # SIGKILL and SIGSTOP have no handler
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def main() -> None:
    """`python -m vlaunch.launcher.keeper COMMAND...`."""
    argv = sys.argv[1:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.stderr.write("usage: python -m vlaunch.launcher.keeper COMMAND [ARG...]\n")
        os._exit(64)
    sys.stdout.flush()
    exit_as(Keeper(argv).run())


if __name__ == "__main__":
    main()
