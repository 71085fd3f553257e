"""Histories for the supervisor's pure core: feed events, assert the actions and the exit."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterable
from typing import Any, TypeVar

import pytest

from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.launcher.core import (
    CACHE_STATUSES,
    EngineState,
    Failure,
    Phase,
    RankState,
    Supervisor,
    SupervisorProtocolError,
    describe_exit,
)
from vlaunch.launcher.core.events import (
    Action,
    CacheReady,
    ChildExited,
    EngineHealth,
    EngineReady,
    Event,
    Exit,
    KillAll,
    Log,
    Notify,
    SignalChild,
    SignalReceived,
    SpawnCache,
    Spawned,
    SpawnEngine,
    Started,
    SupervisorConfig,
    Tick,
)
from vlaunch.launcher.core.model import PHASE_NEXT

A = TypeVar("A")
TERM, KILL = signal.SIGTERM, signal.SIGKILL


# ----------------------------------------------------------------------------- helpers


def config(**overrides: Any) -> SupervisorConfig:
    """Two ranks and an engine that reports readiness itself, unless overridden."""
    return SupervisorConfig(**{"ranks": (0, 1), "has_engine": True,
                               "engine_readiness": "notify", **overrides})


def history(events: Iterable[Event], sup: Supervisor | None = None,
            **overrides: Any) -> tuple[Supervisor, list[Action]]:
    """Feed `events` to a supervisor (a new one unless given); return it and every action."""
    sup = sup or Supervisor(config(**overrides))
    actions: list[Action] = []
    for event in events:
        before = sup.phase
        actions += sup.handle(event)
        assert phase_may_follow(before, sup.phase), f"{event!r}: {before} -> {sup.phase}"
    return sup, actions


def phase_may_follow(before: Phase, after: Phase) -> bool:
    """Whether one event may move the phase from `before` to `after` (PHASE_NEXT; a stop
    with nothing left to wait for, or SIGQUIT, goes through stopping within the event)."""
    nxt = PHASE_NEXT[before]
    return after is before or after in nxt or (after is Phase.STOPPED and Phase.STOPPING in nxt)


def of(kind: type[A], actions: list[Action]) -> list[A]:
    """The actions of one type, in order."""
    return [a for a in actions if isinstance(a, kind)]


def notes(actions: list[Action]) -> list[str]:
    """Every sd_notify assignment, flattened in order."""
    return [f"{k}={v}" for n in of(Notify, actions) for k, v in n.fields.items()]


def logs(actions: list[Action]) -> list[str]:
    """Every log line as 'LEVEL message'."""
    return [f"{a.level} {a.message}" for a in of(Log, actions)]


def exit_of(actions: list[Action]) -> Exit:
    """The single Exit, which must be the last action."""
    exits = of(Exit, actions)
    assert len(exits) == 1 and actions[-1] is exits[0], actions
    return exits[0]


def boot(ranks: Iterable[int] = (0, 1), t: float = 0.0) -> list[Event]:
    """Start; every rank spawned (pid 100+rank) and ready one second later."""
    ranks = tuple(ranks)
    return [Started(t), *(Spawned("cache", r, 100 + r, t) for r in ranks),
            *(CacheReady(r, t + 1) for r in ranks)]


def engine_up(attempt: int = 1, t: float = 2.0) -> list[Event]:
    """The engine's attempt runs as pid 200+attempt and reports ready."""
    return [Spawned("engine", None, 200 + attempt, t), EngineReady(t)]


def engine_exit(attempt: int, status: int, t: float) -> ChildExited:
    """The engine's attempt exited with the raw `status`."""
    return ChildExited("engine", None, 200 + attempt, status, t)


def rank_exit(rank: int, status: int, t: float, pid: int | None = None) -> ChildExited:
    """Cache rank `rank` exited with the raw `status`."""
    return ChildExited("cache", rank, 100 + rank if pid is None else pid, status, t)


SERVING = [*boot(), *engine_up()]


def terms(actions: list[Action]) -> list[tuple[str, int | None]]:
    """The (role, rank) of every SIGTERM sent, in order."""
    return [(s.role, s.rank) for s in of(SignalChild, actions) if s.sig == TERM]


# ------------------------------------------------------------------------------ start


def test_normal_start_spawns_ranks_then_engine_then_ready() -> None:
    sup, first = history(boot()[:-1])
    assert of(SpawnCache, first) == [SpawnCache(0, adopt=False), SpawnCache(1, adopt=False)]
    assert not of(SpawnEngine, first) and sup.snapshot()["phase"] == "loading"
    _, rest = history([boot()[-1], *engine_up()], sup)
    assert of(SpawnEngine, rest) == [SpawnEngine(1)]
    assert notes(first + rest) == [
        "STATUS=loading: 0/2 cache ranks ready", "EXTEND_TIMEOUT_USEC=30000000",
        "STATUS=loading: 1/2 cache ranks ready", "STATUS=starting engine (attempt 1)",
        "READY=1", "STATUS=serving"]
    assert sup.phase is Phase.SERVING and sup.caches_ready and sup.engine_ready
    assert sup.started_ok and sup.exit_status is None


def test_engine_not_ready_until_it_says_so() -> None:
    sup, actions = history([*boot(), Spawned("engine", None, 201, 2)])
    assert "READY=1" not in notes(actions)
    assert sup.phase is Phase.STARTING_ENGINE and sup.caches_ready and not sup.engine_ready


def test_readiness_none_counts_the_spawn_as_ready() -> None:
    sup, actions = history([*boot(), *engine_up()], engine_readiness="none")
    assert notes(actions).count("READY=1") == 1  # the later EngineReady is ignored
    assert sup.engine_ready


def test_caches_only_layout_is_ready_when_every_rank_is() -> None:
    sup, actions = history([*boot(), SignalReceived(signal.SIGHUP, 3)], has_engine=False)
    assert not of(SpawnEngine, actions)
    assert notes(actions)[-2:] == ["READY=1", "STATUS=serving"]
    assert logs(actions)[-1] == "INFO SIGHUP ignored: no engine to restart (caches only)"
    assert sup.phase is Phase.SERVING and sup.engine_ready and sup.engine is None


@pytest.mark.parametrize("status", sorted(CACHE_STATUSES))
def test_rank_start_failure_passes_a_documented_status_on(status: int) -> None:
    sup, actions = history([Started(0), Spawned("cache", 0, 100, 0), Spawned("cache", 1, 101, 0),
                            CacheReady(0, 1), rank_exit(1, status, 2), rank_exit(0, -15, 3)])
    assert exit_of(actions).status == status
    assert not of(SpawnEngine, actions) and terms(actions) == [("cache", 0)]
    assert sup.first_failure == Failure(1, 101, status)


def test_rank_start_failure_bad_checkpoint_log_and_status() -> None:
    _, actions = history([*boot()[:3], rank_exit(1, 65, 2), rank_exit(0, 0, 3)])
    line = "cache rank 1 (pid 101) exited before ready: status 65 (BAD_CHECKPOINT)"
    assert f"ERROR {line}" in logs(actions)
    assert f"STATUS=stopping: {line}" in notes(actions)
    assert exit_of(actions) == Exit(65, line)


def test_rank_sigkilled_before_ready_is_rank_start_failed() -> None:
    sup, actions = history([Started(0), Spawned("cache", 0, 100, 0),
                            Spawned("cache", 1, 4242, 0), rank_exit(1, -9, 5, pid=4242),
                            rank_exit(0, -15, 6)])
    line = ("cache rank 1 (pid 4242) exited before ready: killed by signal 9 "
            "(SIGKILL: the OOM killer?)")
    assert f"ERROR {line}" in logs(actions)
    assert notes(actions)[-2:] == ["STOPPING=1", f"STATUS=stopping: {line}"]
    assert exit_of(actions).status == ExitStatus.RANK_START_FAILED
    assert not of(SpawnEngine, actions) and not sup.started_ok


@pytest.mark.parametrize("status", [0, 1, 69, 80, 82, 137, -11])
def test_rank_start_failure_with_another_status_is_68(status: int) -> None:
    _, actions = history([*boot(ranks=(0,))[:2], rank_exit(0, status, 1)], ranks=(0,))
    assert exit_of(actions).status == ExitStatus.RANK_START_FAILED


# ----------------------------------------------------------------------- rank exits


def test_rank_exit_while_serving_stops_engine_first_then_ranks() -> None:
    sup, actions = history([*SERVING, rank_exit(1, -9, 10)])
    line = "cache rank 1 (pid 101) exited: killed by signal 9 (SIGKILL: the OOM killer?)"
    assert f"ERROR {line}" in logs(actions)
    assert notes(actions)[-2:] == ["STOPPING=1", f"STATUS=stopping: {line}"]
    assert terms(actions) == [("engine", None)]
    assert sup.snapshot()["phase"] == "stopping" and not sup.started_ok and not sup.engine_ready
    _, rest = history([engine_exit(1, -15, 11)], sup)
    assert terms(rest) == [("cache", 0)]
    _, last = history([rank_exit(0, 0, 12)], sup)
    assert exit_of(last) == Exit(69, line)
    assert sup.first_failure == Failure(1, 101, -9) and sup.phase is Phase.STOPPED


def test_rank_3_dies_while_engine_restarts_shutdown_69_first_failure_kept() -> None:
    ranks = (0, 1, 2, 3)
    sup, actions = history([*boot(ranks), *engine_up(), engine_exit(1, 1, 10),
                            rank_exit(3, -9, 10.2), Tick(11), rank_exit(2, 1, 11.5)],
                           ranks=ranks)
    assert of(SpawnEngine, actions) == [SpawnEngine(1)]  # the backoff respawn never happens
    assert terms(actions) == [("cache", 0), ("cache", 1), ("cache", 2)]  # no engine to stop
    assert "INFO cache rank 2 (pid 102) exited: status 1" in logs(actions)
    assert sup.first_failure == Failure(3, 103, -9)
    _, last = history([rank_exit(0, 0, 12), rank_exit(1, 0, 12)], sup)
    assert exit_of(last).status == ExitStatus.RANK_EXITED
    assert exit_of(last).reason.startswith("cache rank 3 (pid 103) exited: killed by signal 9")


def test_rank_exit_cause_wins_over_stop_timeout() -> None:
    sup, actions = history([*SERVING, rank_exit(0, 1, 10), Tick(39.9)])
    assert not of(KillAll, actions)
    _, last = history([Tick(40)], sup)
    assert of(KillAll, last) == [KillAll()]
    assert exit_of(last).status == ExitStatus.RANK_EXITED


def test_respawn_policy_adopts_escrow_and_leaves_the_engine_alone() -> None:
    sup, actions = history([*SERVING, rank_exit(1, -9, 10)], on_rank_exit="respawn")
    assert of(SpawnCache, actions)[-1] == SpawnCache(1, adopt=True)
    assert not of(SignalChild, actions) and "STOPPING=1" not in notes(actions)
    assert notes(actions)[-1] == "STATUS=serving; cache rank 1 respawning"
    assert sup.ranks[1].state is RankState.RESPAWNING and sup.ranks[1].respawns == 1
    assert sup.phase is Phase.SERVING and sup.engine_ready and not sup.caches_ready
    _, rest = history([Spawned("cache", 1, 301, 11), CacheReady(1, 12)], sup)
    assert notes(rest) == ["STATUS=serving"]
    assert "INFO cache rank 1 (pid 301) ready again, from the escrowed slabs" in logs(rest)
    assert sup.caches_ready and sup.first_failure is None


def test_respawned_rank_that_dies_before_ready_shuts_down_69() -> None:
    sup, actions = history([*SERVING, rank_exit(1, -9, 10), Spawned("cache", 1, 301, 11),
                            rank_exit(1, 74, 12, pid=301), engine_exit(1, 0, 13),
                            rank_exit(0, 0, 14)], on_rank_exit="respawn")
    assert "ERROR cache rank 1 (pid 301) exited before it was ready again: status 74 " \
           "(IO_ERROR)" in logs(actions)
    assert exit_of(actions).status == ExitStatus.RANK_EXITED
    assert sup.first_failure == Failure(1, 301, 74)


def test_respawn_policy_does_not_apply_before_the_first_ready() -> None:
    _, actions = history([*boot()[:3], rank_exit(0, -9, 1), rank_exit(1, 0, 2)],
                         on_rank_exit="respawn")
    assert of(SpawnCache, actions) == [SpawnCache(0, False), SpawnCache(1, False)]
    assert exit_of(actions).status == ExitStatus.RANK_START_FAILED


def test_respawned_rank_ready_during_a_stop_is_just_stopped() -> None:
    sup, actions = history([*SERVING, rank_exit(1, -9, 10), SignalReceived(TERM, 11),
                            CacheReady(1, 12)], on_rank_exit="respawn")
    assert sup.ranks[1].state is RankState.READY and notes(actions)[-1].startswith("STATUS=stop")
    _, rest = history([engine_exit(1, -15, 13), rank_exit(0, 0, 14), rank_exit(1, 0, 14)], sup)
    assert terms(rest) == [("cache", 0), ("cache", 1)] and exit_of(rest).status == 0


def test_stale_and_duplicate_events_are_ignored() -> None:
    sup, actions = history([*SERVING, rank_exit(0, 1, 5, pid=999), engine_exit(7, 1, 5),
                            CacheReady(0, 5), EngineReady(5), EngineHealth(True, 5)])
    assert actions == history(SERVING)[1] and sup.phase is Phase.SERVING


# ---------------------------------------------------------------------- engine exits


def crash_loop(n: int, t0: float = 10.0, gap: float = 0.0) -> list[Event]:
    """The engine (attempt 1, ready at 2 s) crashes n times, each respawn crashing at once."""
    events: list[Event] = []
    t = t0
    for attempt in range(1, n + 1):
        events += [engine_exit(attempt, 1, t), Tick(t + 40)]  # any backoff is over by then
        t += 40 + gap
        events += [Spawned("engine", None, 201 + attempt, t)]
    return events


def test_engine_crash_restarts_with_exponential_backoff() -> None:
    _, actions = history([*SERVING, *crash_loop(5)], restart_max=10)
    assert [n for n in notes(actions) if n.startswith("STATUS=restarting engine (attempt")
            and ", in " in n] == [f"STATUS=restarting engine (attempt {k}, in {d} s)"
                               for k, d in [(2, 0.5), (3, 1), (4, 2), (5, 4), (6, 8)]]
    assert of(SpawnEngine, actions) == [SpawnEngine(k) for k in range(1, 7)]
    assert notes(actions).count("RELOADING=1") == 1  # still reloading: never ready again


def test_backoff_is_capped_at_backoff_max() -> None:
    _, actions = history([*SERVING, *crash_loop(5)], restart_max=10, backoff_max=3)
    delays = [a.message.split("restarting it in ")[1].split(" s")[0] for a in of(Log, actions)
              if "restarting it in" in a.message]
    assert delays == ["0.5", "1", "2", "3", "3"]


def test_respawn_waits_for_the_first_tick_at_or_after_due() -> None:
    sup, actions = history([*SERVING, engine_exit(1, 1, 10), Tick(10.49)])
    assert of(SpawnEngine, actions) == [SpawnEngine(1)] and sup.phase is Phase.RESTARTING
    assert sup.engine is not None and sup.engine.state is EngineState.BACKOFF
    _, rest = history([Tick(10.5), *engine_up(2, 11)], sup)
    assert of(SpawnEngine, rest) == [SpawnEngine(2)]
    assert notes(rest)[-2:] == ["READY=1", "STATUS=serving"]


def test_zero_backoff_respawns_in_the_same_call() -> None:
    _, actions = history([*SERVING, engine_exit(1, 1, 10)], backoff_initial=0, backoff_max=0)
    assert of(SpawnEngine, actions) == [SpawnEngine(1), SpawnEngine(2)]


def test_restart_after_ready_sends_reloading_then_ready_again() -> None:
    _, actions = history([*SERVING, engine_exit(1, -11, 10), Tick(11), *engine_up(2, 12)])
    assert notes(actions)[-6:] == ["RELOADING=1", "STATUS=restarting engine (attempt 2, in 0.5 s)",
                                   "EXTEND_TIMEOUT_USEC=30000000",  # systemd's reload timer
                                   "STATUS=restarting engine (attempt 2)", "READY=1",
                                   "STATUS=serving"]
    assert "WARNING engine (pid 201) exited: killed by signal 11 (SIGSEGV); restarting it in " \
           "0.5 s (1 of at most 5 restarts in 300 s)" in logs(actions)


def test_crash_before_first_ready_sends_no_reloading() -> None:
    sup, actions = history([*boot(), Spawned("engine", None, 201, 2), engine_exit(1, 1, 3),
                            Tick(4)])
    assert "RELOADING=1" not in notes(actions) and of(SpawnEngine, actions)[-1] == SpawnEngine(2)
    assert sup.phase is Phase.STARTING_ENGINE


def test_restart_budget_exhausted_exits_80() -> None:
    sup, actions = history([*SERVING, *crash_loop(5), engine_exit(6, 1, 250)])
    assert of(SpawnEngine, actions)[-1] == SpawnEngine(6)
    assert "ERROR engine (pid 206) exited: status 1; restart budget exhausted (6 exits in " \
           "300 s, at most 5 restarts allowed)" in logs(actions)
    assert terms(actions) == [("cache", 0), ("cache", 1)]
    _, last = history([rank_exit(0, 0, 251), rank_exit(1, 0, 251)], sup)
    assert exit_of(last).status == ExitStatus.ENGINE_BUDGET


def test_restarts_older_than_the_window_do_not_count() -> None:
    sup, actions = history([*SERVING, *crash_loop(3, gap=100)], restart_max=2,
                           restart_window=150)
    assert not of(Exit, actions) and sup.phase is Phase.RESTARTING


def test_stable_engine_resets_budget_and_backoff() -> None:
    crashes = [*SERVING, *crash_loop(2), EngineReady(90)]
    _, actions = history([*crashes, engine_exit(3, 1, 150)], restart_max=2)
    assert not of(Exit, actions) and "restarting it in 0.5 s (1 of at most 2" in logs(actions)[-1]
    _, unstable = history([*crashes, engine_exit(3, 1, 149.9)], restart_max=2)
    assert "restart budget exhausted" in logs(unstable)[-1]


def test_engine_config_error_status_exits_81() -> None:
    sup, actions = history([*SERVING, engine_exit(1, 78, 10), rank_exit(0, 0, 11),
                            rank_exit(1, 0, 11)])
    assert not of(SpawnEngine, actions)[1:] and terms(actions) == [("cache", 0), ("cache", 1)]
    assert exit_of(actions).status == ExitStatus.ENGINE_CONFIG
    assert "configuration error" in exit_of(actions).reason and sup.first_failure is None


def test_custom_config_error_statuses() -> None:
    _, actions = history([*SERVING, engine_exit(1, 3, 10), rank_exit(0, 0, 11),
                          rank_exit(1, 0, 11)], engine_config_error_statuses={3, 4})
    assert exit_of(actions).status == ExitStatus.ENGINE_CONFIG


def test_stop_on_engine_success_exits_0() -> None:
    _, actions = history([*SERVING, engine_exit(1, 0, 10), rank_exit(0, 0, 11),
                          rank_exit(1, 0, 11)], stop_on_engine_success=True)
    assert "STOPPING=1" in notes(actions) and exit_of(actions).status == ExitStatus.OK


def test_engine_success_without_the_flag_is_restarted() -> None:
    _, actions = history([*SERVING, engine_exit(1, 0, 10), Tick(11)])
    assert of(SpawnEngine, actions)[-1] == SpawnEngine(2) and not of(Exit, actions)


# ---------------------------------------------------------------------------- signals


def test_sigterm_stops_engine_first_then_ranks_and_exits_0() -> None:
    sup, actions = history([*SERVING, SignalReceived(TERM, 10)])
    assert actions[-2:] == [Notify({"STOPPING": "1", "STATUS": "stopping: SIGTERM received"}),
                            SignalChild("engine", None, TERM)]
    _, rest = history([engine_exit(1, -15, 11)], sup)
    assert terms(rest) == [("cache", 0), ("cache", 1)]
    _, last = history([rank_exit(1, 0, 12), rank_exit(0, 0, 12)], sup)
    assert of(Exit, last[:-1]) == [] and exit_of(last) == Exit(0, "SIGTERM received")
    assert sup.started_ok and sup.snapshot()["phase"] == "stopped"


def test_rank_crash_during_a_graceful_stop_keeps_status_0() -> None:
    sup, actions = history([*SERVING, SignalReceived(TERM, 10), rank_exit(0, -11, 10.5),
                            engine_exit(1, 0, 11), rank_exit(1, 0, 12)])
    assert "WARNING cache rank 0 (pid 100) exited during the stop, unasked: killed by signal " \
           "11 (SIGSEGV)" in logs(actions)
    assert terms(actions) == [("engine", None), ("cache", 1)]
    assert exit_of(actions).status == ExitStatus.OK and sup.first_failure is None


def test_sigint_while_loading_stops_the_ranks_at_once() -> None:
    _, actions = history([*boot()[:3], SignalReceived(signal.SIGINT, 1), rank_exit(0, -15, 2),
                          rank_exit(1, -15, 2)])
    assert terms(actions) == [("cache", 0), ("cache", 1)] and not of(SpawnEngine, actions)
    assert exit_of(actions) == Exit(0, "SIGINT received")


def test_stop_timeout_kills_all_and_exits_82() -> None:
    sup, actions = history([*SERVING, SignalReceived(TERM, 10), Tick(39.9)])
    assert not of(KillAll, actions)
    _, last = history([Tick(40)], sup)
    assert last[-3] == KillAll()  # then the exit log line, then Exit
    assert "ERROR stop timed out after 30 s: killing the engine, cache rank 0, cache rank 1 " \
           "with SIGKILL" in logs(last)
    assert exit_of(last).status == ExitStatus.STOP_TIMEOUT


def test_second_sigterm_kills_now() -> None:
    _, actions = history([*SERVING, SignalReceived(TERM, 10), SignalReceived(signal.SIGINT, 11)])
    assert of(KillAll, actions) == [KillAll()]
    assert exit_of(actions).status == ExitStatus.STOP_TIMEOUT


def test_during_a_failure_stop_the_first_sigterm_waits_and_the_second_kills() -> None:
    sup, actions = history([*SERVING, rank_exit(0, 1, 10), SignalReceived(TERM, 11)])
    assert not of(KillAll, actions) and "send it again" in logs(actions)[-1]
    _, last = history([SignalReceived(TERM, 12)], sup)
    assert of(KillAll, last) and exit_of(last).status == ExitStatus.RANK_EXITED


def test_sighup_restarts_the_engine_outside_the_budget() -> None:
    sup, actions = history([*SERVING, SignalReceived(signal.SIGHUP, 10)], restart_max=0)
    assert actions[-2:] == [Notify({"RELOADING": "1", "STATUS": "restarting engine (SIGHUP)"}),
                            SignalChild("engine", None, TERM, command_only=True)]
    assert sup.phase is Phase.RESTARTING and not sup.engine_ready
    _, rest = history([engine_exit(1, -15, 11), *engine_up(2, 12)], sup)
    assert of(SpawnEngine, rest) == [SpawnEngine(2)]  # at once, no backoff
    assert notes(rest)[-2:] == ["READY=1", "STATUS=serving"]
    assert sup.engine is not None and sup.engine.restarts == 1
    _, crash = history([engine_exit(2, 1, 20)], sup)  # the budget (0) is still whole
    assert "restart budget exhausted (1 exits" in logs(crash)[-1]


def test_sighup_engine_that_ignores_sigterm_is_killed_after_stop_timeout() -> None:
    sup, actions = history([*SERVING, SignalReceived(signal.SIGHUP, 10), Tick(39)])
    assert not [s for s in of(SignalChild, actions) if s.sig == KILL]
    _, rest = history([Tick(40), Tick(41)], sup)
    assert of(SignalChild, rest) == [SignalChild("engine", None, KILL)]
    _, respawn = history([engine_exit(1, -9, 41)], sup)
    assert of(SpawnEngine, respawn) == [SpawnEngine(2)]


def test_sighup_during_backoff_respawns_now() -> None:
    _, actions = history([*SERVING, engine_exit(1, 1, 10), SignalReceived(signal.SIGHUP, 10.1)],
                         backoff_initial=20, backoff_max=20)
    assert of(SpawnEngine, actions)[-1] == SpawnEngine(2)
    assert notes(actions).count("RELOADING=1") == 1


def test_sighup_while_stopping_or_before_the_engine_is_ignored() -> None:
    _, early = history([*boot()[:2], SignalReceived(signal.SIGHUP, 1)])
    assert logs(early)[-1] == "INFO SIGHUP ignored: the engine is pending"
    _, late = history([*SERVING, SignalReceived(TERM, 5), SignalReceived(signal.SIGHUP, 6)])
    assert logs(late)[-1] == "INFO SIGHUP ignored: stopping"


def test_sigterm_during_a_sighup_restart_waits_for_the_engine() -> None:
    _, actions = history([*SERVING, SignalReceived(signal.SIGHUP, 10), SignalReceived(TERM, 11),
                          engine_exit(1, -15, 12), rank_exit(0, 0, 13), rank_exit(1, 0, 13)])
    assert terms(actions) == [("engine", None), ("cache", 0), ("cache", 1)]
    assert of(SpawnEngine, actions) == [SpawnEngine(1)] and exit_of(actions).status == 0


@pytest.mark.parametrize("before", [
    pytest.param(SERVING, id="serving"),
    pytest.param([*boot(), Spawned("engine", None, 201, 2)], id="engine-starting"),
    pytest.param([*SERVING, engine_exit(1, 1, 9.9)], id="engine-in-backoff"),
])
def test_a_sigterm_right_after_a_sighup_is_a_first_sigterm(before: list[Event]) -> None:
    """SIGHUP is a restart, not a stop: a SIGTERM 0.5 ms later begins the graceful stop."""
    sup, actions = history([*before, SignalReceived(signal.SIGHUP, 10),
                            SignalReceived(TERM, 10.0005)])
    assert logs(actions)[-1] == "INFO SIGTERM received: stopping"
    engine = sup.engine.pid if sup.engine and sup.engine.pid else 202
    _, rest = history([ChildExited("engine", None, engine, -15, 10.1),
                       rank_exit(0, 0, 10.2), rank_exit(1, 0, 10.2)], sup)
    assert not of(KillAll, actions + rest)
    assert not [line for line in logs(actions + rest) if "second" in line]
    assert exit_of(rest) == Exit(ExitStatus.OK, "SIGTERM received")


def test_other_signals_are_logged_and_ignored() -> None:
    _, actions = history([*SERVING, SignalReceived(signal.SIGUSR1, 5)])
    assert actions[-1] == Log("WARNING", "SIGUSR1 ignored")


# ----------------------------------------------------------------------- notify timers


def test_extend_timeout_while_loading_until_ready() -> None:
    ticks = [Tick(float(t)) for t in range(1, 61)]
    sup, actions = history([Started(0), *ticks[:35], CacheReady(0, 35), CacheReady(1, 35),
                            *engine_up(t=36), *ticks[35:]])
    extends = [n for n in notes(actions) if n.startswith("EXTEND_TIMEOUT_USEC=")]
    assert extends == ["EXTEND_TIMEOUT_USEC=30000000"] * 4  # at 0, 10, 20 and 30 s
    assert sup.phase is Phase.SERVING


def test_extend_timeout_while_a_restart_is_reported_as_a_reload() -> None:
    """After READY=1, a restart is systemd's reload state (RELOADING=1), timed with
    TimeoutStartSec: EXTEND_TIMEOUT_USEC every 10 s until READY=1 ends it, then none."""
    sup, _ = history([*SERVING, *(Tick(float(t)) for t in range(3, 40))])
    ticks = [Tick(float(t)) for t in range(41, 100)]
    sup, actions = history([engine_exit(1, 1 << 8, 40.5), *ticks[:30],
                            *engine_up(attempt=2, t=71.5), *ticks[30:]], sup)
    extends = [n for n in notes(actions) if n.startswith("EXTEND_TIMEOUT_USEC=")]
    assert "RELOADING=1" in notes(actions)
    assert extends == ["EXTEND_TIMEOUT_USEC=30000000"] * 3  # at 41, 51 and 61 s
    assert sup.phase is Phase.SERVING


def test_watchdog_every_half_interval_and_not_while_stopping() -> None:
    ticks = [Tick(t / 2) for t in range(0, 61)]  # 0 .. 30 s by 0.5 s
    _, actions = history([*SERVING, *ticks, SignalReceived(TERM, 31), Tick(40), Tick(50)],
                         watchdog_interval=10)
    assert notes(actions).count("WATCHDOG=1") == 7  # at 0, 5, 10, 15, 20, 25, 30 s
    _, none = history([*SERVING, *ticks])
    assert "WATCHDOG=1" not in notes(none)


def test_engine_health_failures_drop_readiness() -> None:
    sup, actions = history([*SERVING, EngineHealth(False, 5), EngineHealth(False, 6)],
                           engine_readiness="http")
    assert not sup.engine_ready and sup.phase is Phase.SERVING
    assert notes(actions)[-1] == "STATUS=serving (engine health check failing)"
    assert logs(actions)[-1] == "WARNING engine (pid 201) health check fails: not ready"
    _, rest = history([EngineHealth(True, 7)], sup)
    assert sup.engine_ready and notes(rest) == ["STATUS=serving"]


# ----------------------------------------------------------------------------- surface


def test_snapshot_is_json_and_names_the_first_failure() -> None:
    sup, _ = history([*SERVING, engine_exit(1, 1, 10), Tick(11), Spawned("engine", None, 202, 11),
                      rank_exit(1, -9, 12)])
    snap = json.loads(json.dumps(sup.snapshot()))
    assert snap == {
        "phase": "stopping", "started_ok": False, "caches_ready": False, "engine_ready": False,
        "ranks": [{"rank": 0, "state": "ready", "pid": 100, "last_exit": None, "respawns": 0,
                   "loaded_bytes": 0, "total_bytes": 0},
                  {"rank": 1, "state": "exited", "pid": None, "last_exit": -9, "respawns": 0,
                   "loaded_bytes": 0, "total_bytes": 0}],
        "loaded_bytes": 0, "total_bytes": 0,
        "engine": {"state": "stopping", "pid": 202, "attempt": 2, "restarts": 1,
                   "last_exit": 1, "healthy": True, "failing": [], "hangs": 0,
                   "recent_restarts": 1, "weights": {}, "unhealthy_for": 0.0},
        "first_failure": {"rank": 1, "pid": 101, "status": -9,
                          "description": "killed by signal 9 (SIGKILL: the OOM killer?)"},
        "swap": {"state": "none", "version": 0, "model": "", "label": "", "target_version": 0,
                 "target_model": "", "target_label": "", "mode": "", "swaps": 0,
                 "rollbacks": 0, "failures": 0, "last": ""},
        "stop": {"cause": 69, "reason": "cache rank 1 (pid 101) exited: killed by signal 9 "
                                        "(SIGKILL: the OOM killer?)"},
        "exit_status": None,
    }


def test_snapshot_while_serving_without_an_engine() -> None:
    sup, _ = history(boot(), has_engine=False)
    snap = sup.snapshot()
    assert snap["phase"] == "serving" and snap["engine"] is None and snap["engine_ready"]
    assert [r["state"] for r in snap["ranks"]] == ["ready", "ready"]


def test_events_after_exit_are_ignored() -> None:
    sup, actions = history([*SERVING, SignalReceived(TERM, 1), SignalReceived(TERM, 2)])
    assert exit_of(actions)
    assert sup.handle(Tick(100)) == [] and sup.handle(rank_exit(0, 0, 100)) == []


@pytest.mark.parametrize("events", [
    [Tick(0)],
    [Started(0), Started(1)],
    [Started(0), CacheReady(7, 1)],
    [Started(0), rank_exit(7, 0, 1)],
])
def test_impossible_events_are_executor_bugs(events: list[Event]) -> None:
    with pytest.raises(SupervisorProtocolError):
        history(events)


def test_engine_events_without_an_engine_are_executor_bugs() -> None:
    with pytest.raises(SupervisorProtocolError):
        history([Started(0), Spawned("engine", None, 5, 1)], has_engine=False)
    with pytest.raises(TypeError):
        Supervisor(config()).handle(object())  # type: ignore[arg-type]


@pytest.mark.parametrize("status, text", [
    (0, "status 0"), (3, "status 3"), (137, "status 137 (128+SIGKILL?)"), (300, "status 300"),
    (-9, "killed by signal 9 (SIGKILL: the OOM killer?)"), (-15, "killed by signal 15 (SIGTERM)"),
    (-99, "killed by signal 99"),
])
def test_describe_exit(status: int, text: str) -> None:
    assert describe_exit(status) == text


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize("overrides", [
    {"ranks": ()}, {"ranks": (0, 0)}, {"ranks": (-1,)}, {"ranks": (True,)},
    {"restart_max": -1}, {"restart_window": 0}, {"stable_after": -1},
    {"backoff_initial": float("nan")}, {"backoff_max": 0.1}, {"backoff_factor": 0.5},
    {"stop_timeout": 0}, {"engine_config_error_statuses": {0}},
    {"engine_config_error_statuses": {256}}, {"on_rank_exit": "ignore"},
    {"engine_readiness": "tcp"}, {"watchdog_interval": 0},
])
def test_invalid_config_raises(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="invalid supervisor config"):
        config(**overrides)


def test_config_normalises_collections() -> None:
    c = config(ranks=[2, 3], engine_config_error_statuses=[78, 3])
    assert c.ranks == (2, 3) and c.engine_config_error_statuses == frozenset({3, 78})


# ------------------------------------------------------------------------ preload


def test_preload_runs_between_the_caches_and_the_engine() -> None:
    """Caches ready -> RunPreload; the engine starts only at PreloadDone, even a failed one."""
    from vlaunch.launcher.core.events import PreloadDone, RunPreload

    boot = [Started(0.0), Spawned("cache", 0, 10, 0.1), Spawned("cache", 1, 11, 0.1),
            CacheReady(0, 1.0), CacheReady(1, 1.1)]
    sup, actions = history(boot, preload=True)
    assert of(RunPreload, actions) and not of(SpawnEngine, actions)
    _, later = history([Tick(2.0), PreloadDone(False, "exited with status 3", 5.0)], sup)
    assert of(SpawnEngine, later) == [SpawnEngine(1)]
    assert any("preload command exited with status 3" in line for line in logs(later))
    _, again = history([PreloadDone(True, "", 6.0)], sup)  # a stray second answer: nothing
    assert again == []
    sup, actions = history([*boot, SignalReceived(TERM, 2.0), PreloadDone(True, "", 3.0)],
                           preload=True)
    assert not of(SpawnEngine, actions)  # a stop during the preload: no engine


# ------------------------------------------------------------- start-up deadline, SIGQUIT


def test_a_rank_frozen_in_its_first_load_ends_the_start_with_83() -> None:
    events = [Started(0.0), Spawned("cache", 0, 100, 0.0), Spawned("cache", 1, 101, 0.0),
              CacheReady(0, 5.0), Tick(59.9)]
    sup, actions = history(events, start_timeout=60)
    assert sup.phase is Phase.LOADING and not of(SignalChild, actions)
    _, actions = history([Tick(60.0)], sup)
    assert "ERROR not serving within --start-timeout (60 s): cache rank(s) 1 still loading" \
        in logs(actions)
    assert of(SignalChild, actions) == [SignalChild("cache", 0, TERM),
                                        SignalChild("cache", 1, TERM)]
    _, actions = history([Tick(90.0)], sup)  # a frozen rank ignores SIGTERM: the stop times out
    assert of(KillAll, actions) and exit_of(actions).status == ExitStatus.START_TIMEOUT


def test_an_engine_that_never_becomes_ready_ends_the_start_with_83() -> None:
    events = [*boot(), Spawned("engine", None, 201, 2.0), Tick(30.0), Tick(60.0)]
    sup, actions = history(events, start_timeout=60)
    assert "ERROR not serving within --start-timeout (60 s): the engine (attempt 1) did not " \
           "become ready" in logs(actions)
    assert of(SignalChild, actions) == [SignalChild("engine", None, TERM)]
    _, actions = history([engine_exit(1, 0, 61.0), rank_exit(0, 0, 61.5), rank_exit(1, 0, 61.5)],
                         sup)
    assert exit_of(actions).status == ExitStatus.START_TIMEOUT


def test_the_deadline_restarts_with_each_engine_restart_and_is_off_by_default() -> None:
    events = [*boot(), *engine_up(t=2.0), Tick(500.0), engine_exit(1, 1, 1000.0),
              Tick(1000.5), Spawned("engine", None, 202, 1000.6), Tick(1030.0)]
    sup, actions = history(events, start_timeout=60)
    assert not of(SignalChild, actions)  # serving for a long time is not a start
    _, actions = history([Tick(1060.6)], sup)
    assert any("did not become ready again after a restart" in line for line in logs(actions))
    sup, actions = history([*boot(), Spawned("engine", None, 201, 2.0), Tick(10_000.0)])
    assert sup.phase is Phase.STARTING_ENGINE and not of(SignalChild, actions)


def test_sigquit_kills_every_child_at_once_and_exits_131() -> None:
    _, actions = history([*boot(), *engine_up(), SignalReceived(signal.SIGQUIT, 3.0)])
    tail = actions[actions.index(of(KillAll, actions)[0]) - 2:]
    assert "STOPPING=1" in notes(tail) and of(KillAll, tail)
    assert "WARNING SIGQUIT received: killing the engine, cache rank 0, cache rank 1 with " \
           "SIGKILL now" in logs(actions)
    assert exit_of(actions).status == ExitStatus.QUIT == 131


def test_sigquit_during_a_failure_keeps_the_failure_status() -> None:
    _, actions = history([*boot(), *engine_up(), rank_exit(0, -9, 3.0),
                          SignalReceived(signal.SIGQUIT, 3.5)])
    assert of(KillAll, actions) and exit_of(actions).status == ExitStatus.RANK_EXITED
