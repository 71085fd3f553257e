"""Histories for the supervisor's standby decisions (--standby): promote, replace, give up."""

from __future__ import annotations

import signal

from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.launcher.core import STANDBY_MAX_FAILS, EngineState, Phase, StandbyState
from vlaunch.launcher.core.events import (
    ChildExited,
    EngineReady,
    PromoteStandby,
    SignalChild,
    SignalReceived,
    Spawned,
    SpawnEngine,
    SpawnStandby,
    StandbyParked,
    Tick,
)

from .test_supervisor_core import SERVING, engine_exit, exit_of, history, logs, notes, of, rank_exit

TERM, KILL = signal.SIGTERM, signal.SIGKILL


def parked(number: int = 1, t: float = 3.0) -> list:
    """Standby `number` runs as pid 300+number and parks."""
    return [Spawned("standby", None, 300 + number, t), StandbyParked(t + 1)]


def standby_exit(number: int, status: int, t: float) -> ChildExited:
    """Standby `number` (not promoted) exited with the raw `status`."""
    return ChildExited("standby", None, 300 + number, status, t)


def test_off_by_default_no_standby_is_started() -> None:
    sup, actions = history(SERVING)
    assert not of(SpawnStandby, actions)
    assert "standby" not in sup.snapshot()


def test_engine_ready_starts_one_standby() -> None:
    sup, actions = history(SERVING, standby=True)
    assert of(SpawnStandby, actions) == [SpawnStandby(1)]
    assert sup.snapshot()["standby"]["state"] == "starting"


def test_engine_exit_promotes_the_parked_standby_without_a_spawn() -> None:
    sup, actions = history([*SERVING, *parked(), engine_exit(1, -9, 10.0)], standby=True)
    after = actions[actions.index(of(PromoteStandby, actions)[0]) - 3:]
    assert of(PromoteStandby, actions) == [PromoteStandby()]
    assert not of(SpawnEngine, after[1:]) and of(SpawnEngine, actions) == [SpawnEngine(1)]
    assert sup.engine is not None and sup.engine.pid == 301 and sup.engine.attempt == 2
    assert sup.engine.restarts == 1 and sup.phase is Phase.RESTARTING
    assert "RELOADING=1" in notes(actions)
    # the promoted engine reports ready on its own: READY=1 again, and a new standby starts
    sup, more = history([EngineReady(10.5)], sup)
    assert "READY=1" in notes(more) and of(SpawnStandby, more) == [SpawnStandby(2)]
    assert sup.phase is Phase.SERVING


def test_promoted_engine_exit_reported_as_standby_is_the_engine_exit() -> None:
    sup, _ = history([*SERVING, *parked(), engine_exit(1, 1, 10.0), EngineReady(10.5),
                      standby_exit(1, -9, 20.0)], standby=True)
    assert sup.engine is not None and sup.engine.state is EngineState.BACKOFF
    assert sup.engine.last_exit == -9


def test_promotion_counts_against_the_restart_budget() -> None:
    sup, actions = history([*SERVING, *parked(), engine_exit(1, 1, 10.0)], standby=True,
                           restart_max=0)
    assert not of(PromoteStandby, actions)
    done = history([rank_exit(0, 0, 10.5), rank_exit(1, 0, 10.6), standby_exit(1, 0, 11.0)],
                   sup)[1]
    assert exit_of(done).status == ExitStatus.ENGINE_BUDGET
    assert ("standby", None) in [(s.role, s.rank) for s in of(SignalChild, actions)]


def test_standby_that_parks_during_the_backoff_is_promoted_at_once() -> None:
    sup, actions = history([*SERVING, Spawned("standby", None, 301, 3.0),
                            engine_exit(1, 1, 10.0), StandbyParked(10.1)], standby=True,
                           backoff_initial=5.0)
    assert of(PromoteStandby, actions) == [PromoteStandby()]
    assert of(SpawnEngine, actions) == [SpawnEngine(1)]
    _, later = history([Tick(20.0)], sup)
    assert not of(SpawnEngine, later)


def test_standby_that_dies_is_replaced() -> None:
    sup, actions = history([*SERVING, *parked(), standby_exit(1, -9, 5.0)], standby=True)
    assert of(SpawnStandby, actions) == [SpawnStandby(1), SpawnStandby(2)]
    assert any("replacing it" in line for line in logs(actions))
    assert sup.engine is not None and sup.engine.state is EngineState.READY


def test_standbys_that_keep_dying_before_parking_are_given_up() -> None:
    events = [*SERVING]
    for n in range(1, STANDBY_MAX_FAILS + 1):
        events += [Spawned("standby", None, 300 + n, 3.0 + n), standby_exit(n, 1, 3.5 + n)]
    sup, actions = history(events, standby=True)
    assert len(of(SpawnStandby, actions)) == STANDBY_MAX_FAILS
    assert any("giving standbys up" in line for line in logs(actions))
    # from now on an engine exit is an ordinary restart
    _, more = history([engine_exit(1, 1, 20.0), Tick(21.0)], sup)
    assert of(SpawnEngine, more) == [SpawnEngine(2)] and not of(PromoteStandby, more)


def test_standby_that_never_parks_is_killed_and_given_up_with_a_warning() -> None:
    sup, actions = history([*SERVING, Spawned("standby", None, 301, 3.0), Tick(10.0),
                            Tick(2.0 + 30.0)], standby=True, standby_park_timeout=30.0)
    warnings = [line for line in logs(actions) if line.startswith("WARNING")]
    assert any("did not park within 30 s" in line for line in warnings)
    assert SignalChild("standby", None, KILL) in actions
    sup, more = history([standby_exit(1, -9, 33.0), engine_exit(1, 1, 40.0), Tick(41.0)], sup)
    assert of(SpawnEngine, more) == [SpawnEngine(2)] and not of(SpawnStandby, more)
    assert sup.snapshot()["standby"]["given_up"] is True


def test_shutdown_stops_the_standby_too_and_waits_for_it() -> None:
    sup, actions = history([*SERVING, *parked(), SignalReceived(TERM, 5.0)], standby=True)
    assert SignalChild("standby", None, TERM) in actions
    sup, _ = history([engine_exit(1, 0, 5.1), rank_exit(0, 0, 5.2), rank_exit(1, 0, 5.3)],
                     sup)
    assert sup.exit_status is None  # the standby is still there
    sup, last = history([standby_exit(1, 0, 5.4)], sup)
    assert exit_of(last).status == ExitStatus.OK
    assert sup.snapshot()["standby"]["state"] == StandbyState.NONE.value


def test_promotion_while_a_rank_respawns() -> None:
    sup, actions = history([*SERVING, *parked(), rank_exit(0, -9, 5.0),
                            engine_exit(1, 1, 5.1)], standby=True, on_rank_exit="respawn")
    assert of(PromoteStandby, actions) == [PromoteStandby()]
    assert sup.engine is not None and sup.engine.pid == 301


def test_sighup_restart_promotes_the_parked_standby() -> None:
    sup, actions = history([*SERVING, *parked(), SignalReceived(signal.SIGHUP, 5.0),
                            engine_exit(1, 0, 5.2)], standby=True)
    assert of(PromoteStandby, actions) == [PromoteStandby()]
    assert sup.engine is not None and sup.engine.attempt == 2


def test_sighup_promotion_is_outside_the_budget_and_the_backoff() -> None:
    """A promotion that SIGHUP (`systemctl reload`) triggers counts as a SIGHUP restart: with
    room for one restart, a crash after it is still restarted, after the first backoff."""
    sup, actions = history([*SERVING, *parked(), SignalReceived(signal.SIGHUP, 5.0),
                            engine_exit(1, 0, 5.2), EngineReady(5.5)], standby=True,
                           restart_max=1, backoff_initial=2.0)
    assert of(PromoteStandby, actions) == [PromoteStandby()]
    assert sup.engine is not None and sup.engine.pid == 301 and sup.engine.restarts == 1
    sup, more = history([ChildExited("engine", None, 301, 1, 6.0)], sup)
    assert any(line.startswith("WARNING") and "restarting it in 2 s (1 of at most 1 restarts"
               in line for line in logs(more)), logs(more)
    assert sup.exit_status is None and sup.engine.state is EngineState.BACKOFF
