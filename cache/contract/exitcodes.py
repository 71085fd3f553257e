"""Exit statuses of every vlaunch process: the launcher and the cache ranks.

The numbers are stable and documented (`vlaunch exit-codes`, docs/exit-codes.md). They avoid
the codes that already mean something to a shell or to systemd: 1-2 (generic errors, click's
usage error), 126-127 (exec failures), 128+N (death by signal N) and 200-243 (systemd's own).
Where a sysexits.h code fits, it is used.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class ExitStatus(enum.IntEnum):
    """Exit statuses; `EXIT_TABLE` holds what each means and what to do."""

    OK = 0
    USAGE = 64
    BAD_CHECKPOINT = 65
    NO_MODEL = 66
    CHECKPOINT_CHANGED = 67
    RANK_START_FAILED = 68
    RANK_EXITED = 69
    INTERNAL = 70
    NO_DEVICE = 71
    RANK_STARVED = 72
    SOCKET_DIR = 73
    IO_ERROR = 74
    CACHE_BUSY = 75
    SEED_FAILED = 76
    HOST_BLOCKED = 77
    BAD_PLAN = 78
    VERIFY_FAILED = 79
    ENGINE_BUDGET = 80
    ENGINE_CONFIG = 81
    STOP_TIMEOUT = 82
    START_TIMEOUT = 83
    OUT_OF_MEMORY = 84
    SWAP_ROLLED_BACK = 85
    SWAP_FAILED = 86
    SWAP_UNAVAILABLE = 87
    QUIT = 131


class ExitInfo(NamedTuple):
    """One row of the exit-status table (a NamedTuple: see vlaunch.cache; every process that
    can fail imports this module)."""

    status: ExitStatus
    who: str
    meaning: str
    retry: bool  # would an unchanged restart (systemd Restart=on-failure) help?
    todo: str = ""  # what an operator does about it (markdown: docs/exit-codes.md's last column)


EXIT_TABLE: tuple[ExitInfo, ...] = (
    ExitInfo(ExitStatus.OK, "launcher, cache",
             "Stopped on request (SIGTERM/SIGINT, or the engine finished with "
             "--stop-on-engine-success); every child exited within the stop timeout.", False,
             "nothing"),
    ExitInfo(ExitStatus.USAGE, "launcher, cache",
             "Bad command line, environment variable or config file.", False,
             "read the message above `Error:`; see [Configuration](configuration.md)"),
    ExitInfo(ExitStatus.BAD_CHECKPOINT, "launcher, cache",
             "A checkpoint file failed validation (truncated, bad header, overlapping or "
             "out-of-range tensors, wrong dtype size).", False,
             "re-download or re-save the file the message names"),
    ExitInfo(ExitStatus.NO_MODEL, "launcher, cache",
             "The model path does not exist or holds no .safetensors file.", False,
             "fix `--model`; mount the volume"),
    ExitInfo(ExitStatus.CHECKPOINT_CHANGED, "launcher, cache",
             "A checkpoint file changed (size, modification time or inode) while a cache rank "
             "read it, twice in a row; nothing was served.", True,
             "wait until whatever writes the checkpoint (a download, a copy in place) has "
             "finished, then start again; see [Checkpoint integrity](integrity.md)"),
    ExitInfo(ExitStatus.RANK_START_FAILED, "launcher",
             "A cache rank exited before it was ready, with a status that is not in this "
             "table (a crash, a signal, the OOM killer).", True,
             "look for the rank's last lines and the kernel log (`dmesg`); check host memory"),
    ExitInfo(ExitStatus.RANK_EXITED, "launcher",
             "A cache rank exited while serving; the launcher stopped the engine and the "
             "other ranks.", True,
             "`first_failure` in the log and `/status` names the rank, pid and how it ended"),
    ExitInfo(ExitStatus.INTERNAL, "launcher, cache",
             "Internal error (a bug: please report).", True,
             "report it with the log"),
    ExitInfo(ExitStatus.NO_DEVICE, "launcher, cache",
             "The requested device is missing or unusable: no CUDA GPU, an index out of "
             "range, no NVIDIA driver library (libcuda.so.1), or no room on the GPU for a "
             "slab at the first load (a swap's staging reports 84).", False,
             "check `nvidia-smi`, `CUDA_VISIBLE_DEVICES`, the container's GPU access "
             "(`--gpus`); free the GPU or use more tensor-parallel ranks"),
    ExitInfo(ExitStatus.RANK_STARVED, "cache",
             "A serving cache rank could accept no client for 30 s, even after shedding idle "
             "connections: out of file descriptors (RLIMIT_NOFILE) or another per-process "
             "resource.", True,
             "raise `LimitNOFILE=` / `ulimit -n`, or lower `VLAUNCH_MAX_CONNECTIONS`; look for "
             "an engine that leaks cache connections; see "
             "[Lifecycle](lifecycle.md#connections-and-file-descriptors)"),
    ExitInfo(ExitStatus.SOCKET_DIR, "launcher, cache",
             "The socket directory is unsafe or unusable (a symlink, owned by another user, "
             "group/other permissions, not creatable), or a rank's socket path holds a file "
             "that is not its socket.", False,
             "see [Security](security.md); the message names the fix"),
    ExitInfo(ExitStatus.IO_ERROR, "launcher, cache", "Reading the checkpoint failed (I/O error).",
             True,
             "check the disk or network filesystem"),
    ExitInfo(ExitStatus.CACHE_BUSY, "launcher, cache",
             "Another cache process already holds this rank's lock in the socket directory, "
             "or another launcher uses the socket directory.", True,
             "stop the other launcher, or give each one its own `--socket-dir`"),
    ExitInfo(ExitStatus.SEED_FAILED, "launcher, cache",
             "Seeding a cache rank from a running replica failed (unreachable source, wrong "
             "token, fingerprint mismatch, truncated or corrupt stream) and --seed-fallback "
             "was not given.", True,
             "check the source replica, the token and the ports (see [Artifacts and "
             "seeding](artifacts-and-seeding.md)), or add `--seed-fallback`"),
    ExitInfo(ExitStatus.HOST_BLOCKED, "doctor",
             "vlaunch doctor found a blocker: a host setting under which a deployment breaks "
             "(vlaunch run would exit, or a cache rank could not serve).", False,
             "each blocker's line names its fix; see [Host check](doctor.md)"),
    ExitInfo(ExitStatus.BAD_PLAN, "launcher, cache",
             "The shard plan does not fit the checkpoint (a split dimension does not divide "
             "evenly, a bad plan file or hook, more pipeline stages than layers).", False,
             "change the tensor-parallel size or `--plan`"),
    ExitInfo(ExitStatus.VERIFY_FAILED, "launcher, cache, verify",
             "A full check (vlaunch verify, or --verify after the first load) found tensors "
             "whose bytes in the cache differ from the checkpoint files.", True,
             "the lines above name each tensor; restart the caches to read the files again, "
             "and check the disk and host memory if it happens again; see [Checkpoint "
             "integrity](integrity.md)"),
    ExitInfo(ExitStatus.ENGINE_BUDGET, "launcher",
             "The engine kept exiting: its restart budget was exhausted.", True,
             "read the engine's own log; see `--restart-max`"),
    ExitInfo(ExitStatus.ENGINE_CONFIG, "launcher",
             "The engine exited with a status listed in --engine-config-error-status: a "
             "configuration error that a restart cannot fix.", False,
             "fix the engine's command line or configuration"),
    ExitInfo(ExitStatus.STOP_TIMEOUT, "launcher",
             "A graceful stop ran past --stop-timeout and children had to be killed with "
             "SIGKILL.", True,
             "find out what the engine does on SIGTERM; raise `--stop-timeout`"),
    ExitInfo(ExitStatus.START_TIMEOUT, "launcher",
             "The launcher was not serving within --start-timeout: a cache rank still loading "
             "(or frozen), or an engine that never became ready, at start or after a "
             "restart.", True,
             "the log names what was pending; raise `--start-timeout` for a slow disk; see "
             "[Lifecycle](lifecycle.md#start-up-deadline)"),
    ExitInfo(ExitStatus.OUT_OF_MEMORY, "cache",
             "A cache rank could not get the memory or the threads it needs (a memory limit: "
             "ulimit -v, a container's or a unit's MemoryMax; host memory taken by others).", True,
             "the rank's log says what it was doing; give it the memory of its shard plus "
             "about 2 GB, or lower `--threads`; for a swap, `--mode in-place` or free memory"),
    ExitInfo(ExitStatus.SWAP_ROLLED_BACK, "swap",
             "A swap was abandoned after its cutover began: the new engine did not become "
             "ready (it kept exiting, or ran past --ready-timeout), or became ready on weights "
             "a rank refused it (it loaded them from the disk: a fingerprint mismatch), or a "
             "rank refused the cutover (an in-place commit whose old slabs were still mapped "
             "after --lease-wait); the ranks rolled back and the previous weights serve again.",
             False,
             "the message names the cause; read the new engine's log (it runs the new "
             "checkpoint); `/status` engine.weights names a refusal; see [Changing the "
             "weights](swap.md#failure-and-rollback)"),
    ExitInfo(ExitStatus.SWAP_FAILED, "launcher, swap",
             "A swap could not complete and the launcher stopped: --on-failure stop, a rank "
             "that refused the rollback or did not finish a step in time, a cache rank that "
             "exited after the cutover began (the launcher itself then exits 69), or a stop "
             "that began meanwhile; nothing serves a mix of the two checkpoints.", True,
             "the launcher's log says which; a restart loads `--model` from disk (update it if "
             "the swap was meant to stay)"),
    ExitInfo(ExitStatus.SWAP_UNAVAILABLE, "swap",
             "No swap was made: no launcher answers on the control socket, it is not serving, "
             "another swap is in progress, a cache rank exited while the new weights were "
             "staged, a rank cannot swap in place (known at preparing: nothing stopped), or "
             "no outcome came within --timeout (or the launcher went away: the message says "
             "whether the ranks had begun to cut over).", True,
             "try again once the launcher serves (`vlaunch status`); the message says which"),
    ExitInfo(ExitStatus.QUIT, "launcher",
             "Stopped at once on SIGQUIT: every child was killed with SIGKILL, the socket "
             "directory cleaned (128+3, what a shell reports for a SIGQUIT death).", True,
             "nothing: someone sent SIGQUIT; use SIGTERM for a graceful stop"),
)

CONFIG_ERROR_STATUSES: tuple[int, ...] = tuple(
    int(i.status) for i in EXIT_TABLE
    if not i.retry and i.status != ExitStatus.OK and ("launcher" in i.who or "cache" in i.who))
"""Statuses of the launcher or a cache rank that a restart cannot fix (systemd's
RestartPreventExitStatus=); a `vlaunch swap` command's own statuses are not among them."""


def markdown_table() -> str:
    """EXIT_TABLE as docs/exit-codes.md's table (`vlaunch exit-codes --markdown`); other pages
    link to it instead of restating a status's condition."""
    lines = ["| Status | Name | Who | Restart helps | Meaning | What to do |",
             "| --- | --- | --- | --- | --- | --- |"]
    for i in EXIT_TABLE:
        lines.append(f"| {int(i.status)} | "
                     f"`{i.status.name}` | {i.who} | {'yes' if i.retry else 'no'} | "
                     f"{i.meaning} | {i.todo} |")
    return "\n".join(lines)

