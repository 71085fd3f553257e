"""The supervisor's vocabulary: its configuration, the events it consumes, the actions it returns.

All frozen dataclasses with no behaviour beyond validation; `Supervisor` (supervisor.py) is
the only consumer of events and producer of actions, the executor (launcher/executor.py) the
only producer of events and consumer of actions.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

Role = Literal["cache", "engine", "standby", "draining"]
RankPolicy = Literal["shutdown", "respawn"]
Readiness = Literal["notify", "http", "none"]
Probe = Literal["health", "liveness"]
SwapStepName = Literal["prepare", "stage", "commit", "finish", "rollback", "abort"]
"""What the launcher asks the swapped ranks to do (docs/swap.md)."""
SwapAnswer = Literal["prepared", "staged", "committed", "rolled_back", "refused", "published"]
"""What a rank answers, or (published) reports on its own after a trainer's commit."""
SWAP_MODES = ("auto", "double", "in-place")
SWAP_ON_FAILURE = ("rollback", "stop")


# --------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class SupervisorConfig:
    """What this node runs and the supervisor's policies; validated on construction."""

    ranks: tuple[int, ...]
    has_engine: bool
    restart_max: int = 5
    restart_window: float = 300.0
    stable_after: float = 60.0
    backoff_initial: float = 0.5
    backoff_max: float = 30.0
    backoff_factor: float = 2.0
    stop_timeout: float = 30.0
    engine_config_error_statuses: frozenset[int] = frozenset({78})
    on_rank_exit: RankPolicy = "shutdown"
    engine_readiness: Readiness = "none"
    engine_settle: float = 0.0  # readiness "none": seconds the engine must stay up first
    stop_on_engine_success: bool = False
    watchdog_interval: float | None = None
    preload: bool = False  # run the preload command once, after the caches, before the engine
    start_timeout: float | None = None  # seconds to be serving, at start and after a restart
    standby: bool = False  # keep a parked standby engine, promoted when the engine exits
    standby_park_timeout: float = 300.0  # seconds a standby may take to park, else given up
    unhealthy_after: float | None = None  # seconds of failing health after which it is hung
    engine_watchdog: float | None = None  # WATCHDOG_USEC the engine is given, in seconds
    hang_kill_after: float | None = None  # a hung engine's SIGTERM -> SIGKILL; None: stop_timeout
    model: str = ""  # the checkpoint the ranks load first (/status until a swap replaces it)
    swap_ranks: tuple[int, ...] = ()  # the ranks a swap changes (the target group); (): all
    listening: bool = False  # the launcher holds the engine's sockets (--listen, activation)
    drain_timeout: float | None = None  # an engine replaced on purpose: SIGTERM -> SIGKILL

    def __post_init__(self) -> None:
        """Normalise the collections and raise ValueError naming every invalid field."""
        object.__setattr__(self, "ranks", tuple(self.ranks))
        object.__setattr__(self, "swap_ranks", tuple(self.swap_ranks))
        statuses = frozenset(self.engine_config_error_statuses)
        object.__setattr__(self, "engine_config_error_statuses", statuses)
        problems = list(_config_problems(self))
        if problems:
            raise ValueError("invalid supervisor config: " + "; ".join(problems))


def _config_problems(c: SupervisorConfig) -> Iterator[str]:
    """Yield one message per invalid field of `c`."""
    if not c.ranks or len(set(c.ranks)) != len(c.ranks) or not all(_is_count(r) for r in c.ranks):
        yield f"ranks must be distinct non-negative integers, at least one (got {c.ranks!r})"
    if not _is_count(c.restart_max):
        yield f"restart_max must be an integer >= 0 (got {c.restart_max!r})"
    for name in ("restart_window", "stop_timeout"):
        if not _finite(getattr(c, name)) or getattr(c, name) <= 0:
            yield f"{name} must be a finite number > 0 (got {getattr(c, name)!r})"
    for name in ("stable_after", "backoff_initial", "engine_settle"):
        if not _finite(getattr(c, name)) or getattr(c, name) < 0:
            yield f"{name} must be a finite number >= 0 (got {getattr(c, name)!r})"
    if not _finite(c.backoff_max) or c.backoff_max < c.backoff_initial:
        yield f"backoff_max must be finite and >= backoff_initial (got {c.backoff_max!r})"
    if not _finite(c.backoff_factor) or c.backoff_factor < 1:
        yield f"backoff_factor must be a finite number >= 1 (got {c.backoff_factor!r})"
    if not all(_is_count(s) and 0 < s < 256 for s in c.engine_config_error_statuses):
        yield "engine_config_error_statuses must be exit codes 1-255"
    if c.on_rank_exit not in ("shutdown", "respawn"):
        yield f"on_rank_exit must be 'shutdown' or 'respawn' (got {c.on_rank_exit!r})"
    if c.engine_readiness not in ("notify", "http", "none"):
        yield f"engine_readiness must be 'notify', 'http' or 'none' (got {c.engine_readiness!r})"
    if c.watchdog_interval is not None and not (_finite(c.watchdog_interval)
                                                and c.watchdog_interval > 0):
        yield f"watchdog_interval must be None or > 0 (got {c.watchdog_interval!r})"
    if c.start_timeout is not None and not (_finite(c.start_timeout) and c.start_timeout > 0):
        yield f"start_timeout must be None or > 0 (got {c.start_timeout!r})"
    if not _finite(c.standby_park_timeout) or c.standby_park_timeout <= 0:
        yield f"standby_park_timeout must be a finite number > 0 (got {c.standby_park_timeout!r})"
    for name in ("unhealthy_after", "engine_watchdog"):
        value = getattr(c, name)
        if value is not None and not (_finite(value) and value > 0):
            yield f"{name} must be None or a finite number > 0 (got {value!r})"
    if c.hang_kill_after is not None and not (_finite(c.hang_kill_after)
                                              and c.hang_kill_after >= 0):
        yield f"hang_kill_after must be None or a finite number >= 0 (got {c.hang_kill_after!r})"
    if c.drain_timeout is not None and not (_finite(c.drain_timeout) and c.drain_timeout >= 0):
        yield f"drain_timeout must be None or a finite number >= 0 (got {c.drain_timeout!r})"
    if c.standby and not c.has_engine:
        yield "standby needs an engine command (there is nothing to keep a standby of)"
    if not set(c.swap_ranks) <= set(c.ranks):
        yield f"swap_ranks must be some of ranks (got {c.swap_ranks!r})"


def _is_count(value: object) -> bool:
    """Whether `value` is a plain non-negative int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _finite(value: object) -> bool:
    """Whether `value` is a real, finite number."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SwapPolicy:
    """How one swap is carried out: `vlaunch swap`'s options (docs/swap.md)."""

    mode: str = "auto"  # auto (double if every device has room), double, in-place
    on_failure: str = "rollback"  # the new engine never got ready: roll back, or stop (86)
    standby: bool = True  # cut over to a standby when the launcher keeps one
    margin: int = 1 << 30  # bytes a device must have free beyond the new shard (double)
    lease_wait: float = 10.0  # seconds an in-place copy waits for other leases to end
    attempts: int = 3  # exits of the new engine before it was ready, then on_failure
    ready_timeout: float = 300.0  # seconds from the cutover until the new engine is ready

    def __post_init__(self) -> None:
        """Raise ValueError naming every invalid field."""
        problems = []
        if self.mode not in SWAP_MODES:
            problems.append(f"mode must be one of {', '.join(SWAP_MODES)} (got {self.mode!r})")
        if self.on_failure not in SWAP_ON_FAILURE:
            problems.append(f"on_failure must be rollback or stop (got {self.on_failure!r})")
        if not _is_count(self.margin):
            problems.append(f"margin must be bytes >= 0 (got {self.margin!r})")
        if not _is_count(self.attempts) or self.attempts < 1:
            problems.append(f"attempts must be an integer >= 1 (got {self.attempts!r})")
        for name in ("lease_wait", "ready_timeout"):
            if not _finite(getattr(self, name)) or getattr(self, name) < 0:
                problems.append(f"{name} must be a finite number >= 0 (got "
                                f"{getattr(self, name)!r})")
        if problems:
            raise ValueError("invalid swap policy: " + "; ".join(problems))


# --------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Started:
    """The executor's loop began; the first event, exactly once."""

    now: float


@dataclass(frozen=True)
class CacheReady:
    """A cache rank bound its socket: its whole shard is loaded and served."""

    rank: int
    now: float


@dataclass(frozen=True)
class ChildExited:
    """A child was reaped; `status` >= 0 is its exit code, < 0 the signal that killed it."""

    role: Role
    rank: int | None
    pid: int
    status: int
    now: float


@dataclass(frozen=True)
class CacheProgress:
    """A loading cache rank reported `loaded` of its `total` bytes."""

    rank: int
    loaded: int
    total: int
    now: float


@dataclass(frozen=True)
class EngineReady:
    """The engine said it is ready (sd_notify READY=1, or its health URL first answered)."""

    now: float


@dataclass(frozen=True)
class EngineHealth:
    """One probe of a running engine answered (`ok`) or failed (`detail` says how): its health
    URL, or its liveness request."""

    ok: bool
    now: float
    probe: Probe = "health"
    detail: str = ""


@dataclass(frozen=True)
class EngineWatchdog:
    """The engine (or the standby, by `role`) sent WATCHDOG=1 on its notify socket."""

    role: Role
    now: float


@dataclass(frozen=True)
class SignalReceived:
    """The launcher received `sig` (SIGTERM/SIGINT: stop; SIGHUP: restart the engine)."""

    sig: int
    now: float


@dataclass(frozen=True)
class Tick:
    """Time passed: fires due backoffs, timeouts, watchdog and start-timeout extensions."""

    now: float


@dataclass(frozen=True)
class Spawned:
    """A spawn action succeeded: the child runs as `pid` (rank is None for the engine)."""

    role: Role
    rank: int | None
    pid: int
    now: float


@dataclass(frozen=True)
class PreloadDone:
    """The preload command finished (`ok`) or failed, timed out or could not start (`detail`)."""

    ok: bool
    detail: str
    now: float


@dataclass(frozen=True)
class StandbyParked:
    """The standby engine sent PARKED=1: it waits on its promote fd (cache/contract/standby.py)."""

    now: float


@dataclass(frozen=True)
class EngineWeights:
    """Cache rank `rank` answered a hello of a process of the engine's or the standby's (`pid`:
    the one the launcher started, as Spawned named it): `ok`, it maps its weights from that
    cache; else `why` the rank refused them (the engine then loads them from elsewhere, the
    disk, or exits)."""

    rank: int
    pid: int
    ok: bool
    why: str
    now: float


@dataclass(frozen=True)
class SwapRequested:
    """`vlaunch swap` asked (on the control socket, as `request`) for new weights: `model`."""

    request: int
    model: str
    policy: SwapPolicy
    now: float


@dataclass(frozen=True)
class SwapStep:
    """A swapped rank answered a swap step of `version` (`answer`), or reported that a trainer
    committed a published version (`published`, with its `label` and staging `mode`).

    prepared: every check passed; `fits`: the device has room for the new shard beside the
    old one; `in_place`: why the rank would refuse an in-place cutover ("" when it would
    not). refused: `status` (an exit status) and `message` say why."""

    rank: int
    answer: SwapAnswer
    version: int
    now: float
    fits: bool = False
    status: int = 0
    message: str = ""
    label: str = ""
    mode: str = ""
    in_place: str = ""


Event = (Started | CacheReady | ChildExited | EngineReady | EngineHealth | SignalReceived
         | Tick | Spawned | PreloadDone | CacheProgress | StandbyParked | EngineWatchdog
         | SwapRequested | SwapStep | EngineWeights)


# -------------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class SpawnCache:
    """Start the cache process of `rank`; `adopt`: from the escrowed slabs, not the disk."""

    rank: int
    adopt: bool


@dataclass(frozen=True)
class SpawnEngine:
    """Start the engine command; `attempt` counts from 1 over the launcher's life."""

    attempt: int


@dataclass(frozen=True)
class SignalChild:
    """Send `sig` to a child's process group (`rank` is None for the engine and the standby);
    `command_only`: to the engine's command alone, not its workers (a planned stop's SIGTERM:
    the command drains, then stops its workers itself; see SignalDraining)."""

    role: Role
    rank: int | None
    sig: int
    command_only: bool = False


@dataclass(frozen=True)
class KillAll:
    """SIGKILL every remaining child and its process group, then sweep what is left."""


@dataclass(frozen=True)
class Notify:
    """Send one sd_notify message made of these assignments, in order."""

    fields: dict[str, str]


@dataclass(frozen=True)
class Log:
    """Write one log line at `level` (a logging level name)."""

    level: str
    message: str


@dataclass(frozen=True)
class Exit:
    """End the launcher with `status`; always the last action."""

    status: int
    reason: str


@dataclass(frozen=True)
class RunPreload:
    """Run the preload command to completion (bounded by its timeout); answer PreloadDone."""


@dataclass(frozen=True)
class SpawnStandby:
    """Start the engine command as a standby (`number` counts standbys from 1); answered by
    Spawned/ChildExited with role "standby", and StandbyParked once it is parked.
    `next_weights`: for an in-place swap, it gets the new weights' environment and parks
    before it maps any weight (the old ones are overwritten before its promotion)."""

    number: int
    next_weights: bool = False


@dataclass(frozen=True)
class PromoteStandby:
    """Promote the parked standby: write PROMOTE on its fd; from now on it is the engine (its
    exit may still arrive with role "standby")."""


@dataclass(frozen=True)
class RetireEngine:
    """The serving engine `pid` is being replaced on purpose while it may still finish what
    it holds: from now on it is a draining engine (its exit arrives with role "draining"),
    no longer the engine; the next action promotes the standby."""

    pid: int


@dataclass(frozen=True)
class SignalDraining:
    """Send `sig` to the draining engine `pid`: SIGTERM to its command alone (its workers, a
    vLLM engine core, would stop at once and fail what the command still answers), SIGKILL to
    its whole process group (systemd's KillMode=mixed)."""

    pid: int
    sig: int


@dataclass(frozen=True)
class SwapRanks:
    """Send swap `step` of `version` to every swapped rank (`ranks`: only these), which
    answers with a SwapStep (finish and abort are not answered). `model`, `mode` and `policy`
    go with prepare; `mode` with stage and commit; `status` and `message` tell a publishing
    trainer how its version ended (finish: 0)."""

    step: SwapStepName
    version: int
    model: str = ""
    mode: str = ""
    policy: SwapPolicy | None = None
    ranks: tuple[int, ...] = ()
    status: int = 0
    message: str = ""


@dataclass(frozen=True)
class SwapReply:
    """Answer the `vlaunch swap` of `request` (0: a published version, nobody to answer):
    accepted (not `final`), then its outcome once (`status` 0: the new weights serve)."""

    request: int
    final: bool
    status: int
    message: str
    version: int
    mode: str = ""


Action = (SpawnCache | SpawnEngine | SignalChild | KillAll | Notify | Log | Exit | RunPreload
          | SpawnStandby | PromoteStandby | SwapRanks | SwapReply | RetireEngine
          | SignalDraining)
