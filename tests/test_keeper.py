"""The keeper (launcher/keeper.py) with real processes: the engine's status passed through, and
nothing it started left behind, whether it exits, is killed or its launcher dies."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from .conftest import eventually

KEEPER = [sys.executable, "-m", "vlaunch.launcher.keeper", "--"]
# A command that starts a daemon (out of the process group, as some engines' workers go),
# writes the daemon's pid, then does what argv[1] says.
WITH_DAEMON = """
import os, subprocess, sys, time
d = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(600)"])
open(sys.argv[2], "w").write(str(d.pid))
if sys.argv[1] == "exit":
    sys.exit(3)
time.sleep(600)
"""


def keep(*argv: str, **kw: object) -> subprocess.Popen[bytes]:
    """Start argv under a keeper, in its own session (as the launcher does)."""
    return subprocess.Popen([*KEEPER, *argv], start_new_session=True, **kw)  # type: ignore


def gone(pid: int) -> bool:
    """Whether `pid` is dead (a zombie counts as dead)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def fd_targets(pid: int) -> set[str]:
    """What the open fds of `pid` point to (an fd closed meanwhile is left out)."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


def daemon_pid(path: Path) -> int:
    """The daemon's pid once the command wrote it."""
    return int(eventually(lambda: path.exists() and path.read_text(), 30, what="the daemon"))


@pytest.mark.parametrize("script,status", [("raise SystemExit(3)", 3),
                                           ("import os; os.kill(os.getpid(), 9)", -9),
                                           ("import os; os.kill(os.getpid(), 15)", -15)])
def test_the_command_status_is_the_keepers(script: str, status: int) -> None:
    assert keep(sys.executable, "-c", script).wait(30) == status


def test_a_missing_command_is_127_with_a_message() -> None:
    proc = keep("/nonexistent/engine", stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 127
    assert b"cannot start /nonexistent/engine" in err and b"check the command and PATH" in err


def test_what_the_command_left_running_dies_when_it_exits(tmp_path: Path) -> None:
    proc = keep(sys.executable, "-c", WITH_DAEMON, "exit", str(tmp_path / "pid"))
    daemon = daemon_pid(tmp_path / "pid")
    assert proc.wait(30) == 3
    assert gone(daemon)


def test_a_killed_parent_takes_the_command_and_its_daemon_down(tmp_path: Path) -> None:
    """The launcher stands in as a parent that dies by SIGKILL (its child, the keeper, has the
    parent-death signal as under the launcher)."""
    parent = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
from vlaunch.cache.contract.lifetime import die_with_parent
k = subprocess.Popen({[*KEEPER, sys.executable, "-c", WITH_DAEMON, "wait",
                        str(tmp_path / "pid")]!r},
                     start_new_session=True, preexec_fn=die_with_parent)
print(k.pid, flush=True)
time.sleep(600)
"""], stdout=subprocess.PIPE)
    assert parent.stdout is not None
    keeper = int(parent.stdout.readline())
    daemon = daemon_pid(tmp_path / "pid")
    command = [p.pid for p in psutil.Process(keeper).children()]
    parent.kill()
    parent.wait(10)
    for pid in (keeper, daemon, *command):
        eventually(lambda pid=pid: gone(pid), 20, what=f"pid {pid} to go")


def test_a_signal_to_the_keeper_reaches_a_command_that_left_its_group(tmp_path: Path) -> None:
    out = tmp_path / "got"
    proc = keep(sys.executable, "-c", f"""
import os, signal, sys, time
os.setpgrp()
signal.signal(signal.SIGTERM, lambda *a: (open({str(out)!r}, "w").write("TERM"), sys.exit(0)))
open({str(out)!r} + ".ready", "w").close()
time.sleep(600)
""")
    eventually(lambda: Path(f"{out}.ready").exists(), 30, what="the command")
    proc.send_signal(signal.SIGTERM)  # the keeper alone, not its group
    assert proc.wait(30) == 0 and out.read_text() == "TERM"


def test_the_command_gets_the_fds_and_its_own_watchdog_pid(tmp_path: Path) -> None:
    r, w = os.pipe()
    out = tmp_path / "env"
    proc = keep(sys.executable, "-c", f"""
import os, sys
open({str(out)!r}, "w").write(f"{{os.environ.get('WATCHDOG_PID')}} {{os.getpid()}} "
                              f"{{os.read({r}, 4).decode()}}")
""", pass_fds=(r,), env={**os.environ, "WATCHDOG_USEC": "1000000"})
    os.close(r)
    os.write(w, b"ping")
    assert proc.wait(30) == 0
    watchdog_pid, pid, data = out.read_text().split()
    assert watchdog_pid == pid and data == "ping"
    os.close(w)


def test_the_keeper_holds_no_fd_of_the_command(tmp_path: Path) -> None:
    """A standby's promote pipe: a keeper holding its read end would hide the standby's exit
    from the launcher's write."""
    r, w = os.pipe()
    proc = keep(sys.executable, "-c", "import time; time.sleep(600)", pass_fds=(r,))
    os.close(r)
    pipe = f"pipe:[{os.fstat(w).st_ino}]"
    children = eventually(lambda: psutil.Process(proc.pid).children(), 30, what="the command")
    eventually(lambda: pipe in fd_targets(children[0].pid), 30, what="the command's pipe")
    eventually(lambda: pipe not in fd_targets(proc.pid), 30, what="the keeper to close it")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    # the keeper can be reaped before its child has finished exiting (launcher/children.py,
    # group_running): wait for the command too
    eventually(lambda: gone(children[0].pid), 30, what="the command to exit")
    with pytest.raises(BrokenPipeError):
        os.write(w, b"x")  # the command's death closed the last read end
    os.close(w)



def test_a_signal_before_the_command_starts_reaches_it() -> None:
    """A stop that began while a standby was starting: the launcher's SIGTERM to the group came
    before the keeper had started its command, so only the keeper got it. The command gets
    it once started (a CI run of 2026-12-03: the new standby parked on, unstopped, and the
    stop ended in its timeout, 82). Here the keeper receives it before run() forks."""
    script = (
        "import os, signal, sys\n"
        "from vlaunch.launcher.keeper import PASSED_ON, Keeper\n"
        "k = Keeper([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "for sig in PASSED_ON:\n"
        "    signal.signal(sig, k._on_signal)\n"
        "os.kill(os.getpid(), signal.SIGTERM)  # the group's signal: no command yet\n"
        "status = k.run()\n"
        "print(os.WIFSIGNALED(status) and os.WTERMSIG(status))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=45, start_new_session=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(int(signal.SIGTERM))  # killed by it, not after 60 s


def test_command_sigterm_reaches_the_command_alone_and_its_workers_die_after_it(
        tmp_path: Path) -> None:
    """A planned stop (a drain): COMMAND_SIGTERM to the keeper alone is SIGTERM to the command
    only; its worker, in the same group, is not signalled (a vLLM engine core would stop at
    once and fail what the server still answers) and dies with the command's exit."""
    from vlaunch.launcher.keeper import COMMAND_SIGTERM

    out = tmp_path / "got"
    proc = keep(sys.executable, "-c", f"""
import signal, subprocess, sys, time
w = subprocess.Popen([sys.executable, "-c", '''
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: (open({str(out)!r} + ".worker", "w").write("TERM"),
                                          sys.exit(0)))
open({str(out)!r} + ".wpid", "w").write(str(__import__("os").getpid()))
time.sleep(600)
'''])
signal.signal(signal.SIGTERM, lambda *a: (open({str(out)!r}, "w").write("TERM"), sys.exit(0)))
open({str(out)!r} + ".ready", "w").close()
time.sleep(600)
""")
    eventually(lambda: Path(f"{out}.ready").exists() and Path(f"{out}.wpid").exists(), 30,
               what="the command and its worker")
    worker = int(Path(f"{out}.wpid").read_text())
    os.kill(proc.pid, COMMAND_SIGTERM)  # the keeper alone
    assert proc.wait(30) == 0 and out.read_text() == "TERM"
    assert not Path(f"{out}.worker").exists()  # never SIGTERMed: SIGKILLed after the command
    eventually(lambda: gone(worker), 30, what="the worker's end")
