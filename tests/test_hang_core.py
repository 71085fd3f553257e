"""Histories for hang detection (--engine-unhealthy-after, the liveness request, the engine
watchdog): a hung engine is stopped and restarted like a crashed one, and a parked standby
that stops pinging is replaced."""

from __future__ import annotations

import signal

import pytest

from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.launcher.core import EngineState, Phase, Supervisor
from vlaunch.launcher.core.events import (
    CacheReady,
    ChildExited,
    EngineHealth,
    EngineReady,
    EngineWatchdog,
    Event,
    PromoteStandby,
    SignalChild,
    SignalReceived,
    SpawnCache,
    Spawned,
    SpawnEngine,
    SpawnStandby,
    StandbyParked,
    SupervisorConfig,
    Tick,
)

from .test_supervisor_core import (
    SERVING,
    engine_exit,
    exit_of,
    history,
    logs,
    notes,
    of,
    rank_exit,
)

TERM, KILL = signal.SIGTERM, signal.SIGKILL
HTTP = {"engine_readiness": "http", "unhealthy_after": 3.0, "stop_timeout": 5.0}


def ticks(start: float, end: float, step: float = 0.5) -> list[Tick]:
    """A tick every `step` seconds from `start` to `end`, both included."""
    n = round((end - start) / step)
    return [Tick(start + i * step) for i in range(n + 1)]


def health(ok: bool, start: float, end: float, probe: str = "health") -> list[Event]:
    """One probe result a second from `start` to `end`, each followed by a tick."""
    out: list[Event] = []
    for t in range(int(start), int(end) + 1):
        out += [EngineHealth(ok, float(t), probe, "" if ok else "HTTP 503"), Tick(float(t))]
    return out


def signals(actions: list) -> list[tuple[str, int]]:
    """(role, signal) of every SignalChild, in order."""
    return [(s.role, s.sig) for s in of(SignalChild, actions)]


# --------------------------------------------------------------------- the health URL


def test_health_failing_that_long_stops_the_engine_then_kills_it_then_restarts() -> None:
    sup, actions = history([*SERVING, *health(False, 5, 7)], **HTTP)
    assert not of(SignalChild, actions) and sup.engine is not None
    assert sup.engine.failing == ("health",) and not sup.engine_ready
    sup, hung = history([*health(False, 8, 8)], sup)  # failing since 5: 3 s at 8
    assert signals(hung) == [("engine", TERM)]
    assert logs(hung)[0] == ("ERROR engine (pid 201) hung, stopping it (SIGTERM, SIGKILL after "
                             "5 s): health check fails (HTTP 503), failing for 3.0 s "
                             "(--engine-unhealthy-after 3)")
    assert notes(hung) == ["RELOADING=1", "STATUS=restarting engine (hung)"]
    assert sup.engine.state is EngineState.STOPPING and sup.engine.hangs == 1
    assert sup.phase is Phase.RESTARTING and sup.snapshot()["engine"]["hangs"] == 1
    sup, more = history([*health(False, 9, 12), Tick(12.9)], sup)  # no second SIGTERM
    assert not of(SignalChild, more)
    sup, killed = history([Tick(13.0)], sup)
    assert signals(killed) == [("engine", KILL)]
    assert "ignored SIGTERM for 5 s: killing it" in logs(killed)[0]
    sup, gone = history([engine_exit(1, -9, 13.1)], sup)
    assert logs(gone) == ["WARNING hung engine (pid 201) stopped (health check fails (HTTP "
                          "503)): killed by signal 9 (SIGKILL); restarting it in 0.5 s (1 of at "
                          "most 5 restarts in 300 s)"]
    sup, again = history([Tick(13.6), Spawned("engine", None, 202, 13.7), EngineReady(14)], sup)
    assert of(SpawnEngine, again) == [SpawnEngine(2)] and sup.engine_ready
    assert sup.engine.failing == () and sup.engine.hangs == 1


def test_a_health_check_that_passes_in_between_is_not_a_hang() -> None:
    flaky = [*health(False, 5, 6), *health(True, 7, 7), *health(False, 8, 10),
             *health(True, 11, 11), *health(False, 12, 14)]
    sup, actions = history([*SERVING, *flaky], **HTTP)
    assert not of(SignalChild, actions) and sup.engine is not None
    assert sup.engine.state is EngineState.READY
    assert logs(actions).count("INFO engine (pid 201) health check passes again") == 2


def test_off_by_default_a_failing_health_check_only_drops_readiness() -> None:
    sup, _ = history(SERVING, engine_readiness="http")
    sup, actions = history(health(False, 5, 600), sup)
    assert not of(SignalChild, actions) and sup.phase is Phase.SERVING and not sup.engine_ready
    assert logs(actions) == ["WARNING engine (pid 201) health check fails (HTTP 503): not ready"]


def test_checks_start_once_the_engine_is_ready() -> None:
    boot_only = SERVING[:-1]  # the engine runs but never said it is ready
    sup, actions = history([*boot_only, *health(False, 2, 60)], **HTTP)
    assert not of(SignalChild, actions) and sup.phase is Phase.STARTING_ENGINE


def test_a_hung_engine_that_exits_0_or_78_is_restarted_all_the_same() -> None:
    for status in (0, 78):
        sup, actions = history([*SERVING, *health(False, 5, 8), engine_exit(1, status, 9)],
                               stop_on_engine_success=True, **HTTP)
        assert sup.exit_status is None and sup.phase is Phase.RESTARTING
        assert "restarting it in 0.5 s" in logs(actions)[-1]


def test_engines_that_keep_hanging_exhaust_the_budget_with_80() -> None:
    """Each engine fails 1 s after ready and exits 5 s after ready (> stable_after 4.5):
    stability counts up to the failure, so the budget does not reset and the hang loop ends
    as an exit loop would."""
    events: list[Event] = [*SERVING]
    t = 2.0
    for attempt in range(1, 4):
        if attempt > 1:
            events += [Spawned("engine", None, 200 + attempt, t), EngineReady(t)]
        events += [*health(False, t + 1, t + 4), engine_exit(attempt, -15, t + 5)]
        t += 6
    sup, actions = history(events, restart_max=2, stable_after=4.5, backoff_initial=0, **HTTP)
    assert "restart budget exhausted (3 exits in 300 s" in logs(actions)[-1]
    _, done = history([rank_exit(0, 0, t + 1), rank_exit(1, 0, t + 1)], sup)
    assert exit_of(done).status == ExitStatus.ENGINE_BUDGET


def test_a_stop_during_a_hang_waits_for_the_engine_and_does_not_restart_it() -> None:
    sup, _ = history([*SERVING, *health(False, 5, 8)], **HTTP)
    sup, actions = history([SignalReceived(TERM, 9), engine_exit(1, -9, 10), *ticks(10, 12)],
                           sup)
    assert not of(SpawnEngine, actions) and sup.phase is Phase.STOPPING
    assert signals(actions) == [("cache", TERM), ("cache", TERM)]  # the engine had its SIGTERM


# -------------------------------------------------------------------- the liveness request


def test_a_lying_health_check_is_caught_by_the_liveness_request() -> None:
    probes: list[Event] = []
    for t in range(5, 10):
        probes += [EngineHealth(True, float(t)),
                   EngineHealth(False, t + 0.5, "liveness", "timed out after 2 s"),
                   Tick(t + 0.5)]
    _, actions = history([*SERVING, *probes], **HTTP)
    assert "STATUS=serving (engine liveness request failing)" in notes(actions)
    assert signals(actions) == [("engine", TERM)]
    assert "SIGKILL after 5 s): liveness request fails (timed out after 2 s), failing for " \
        "3.0 s" in logs(actions)[-1]


def test_failing_probes_in_turn_are_one_continuous_failure() -> None:
    relay = [EngineHealth(False, 5, "health"), Tick(5), EngineHealth(False, 6, "liveness"),
             EngineHealth(True, 6.5, "health"), Tick(7), EngineHealth(True, 7.5, "health"),
             Tick(8)]
    _, actions = history([*SERVING, *relay], **HTTP)
    assert signals(actions) == [("engine", TERM)]  # unhealthy since 5, not since 6
    assert "failing for 3.0 s" in logs(actions)[-1]


# ------------------------------------------------------------------------- the watchdog


def pings(start: float, end: float, every: float = 1.0) -> list[Event]:
    """WATCHDOG=1 from the engine every `every` seconds, each followed by a tick."""
    out: list[Event] = []
    t = start
    while t <= end:
        out += [EngineWatchdog("engine", t), Tick(t)]
        t += every
    return out


WATCHDOG = {"unhealthy_after": 3.0, "engine_watchdog": 2.0, "stop_timeout": 5.0}


def test_an_engine_that_pings_is_never_hung() -> None:
    sup, actions = history([*SERVING, *pings(3, 100)], **WATCHDOG)
    assert not of(SignalChild, actions) and sup.engine_ready


def test_missed_pings_fail_the_watchdog_then_hang_the_engine() -> None:
    sup, actions = history([*SERVING, *pings(3, 10), *ticks(10.5, 12.5)], **WATCHDOG)
    assert "WARNING engine (pid 201) watchdog fails (no WATCHDOG=1 for 2 s): not ready; hung " \
        "after 3 s of failing (--engine-unhealthy-after)" in logs(actions)
    assert not sup.engine_ready and not of(SignalChild, actions)
    sup, back = history([*pings(13, 13)], sup)  # a late ping: it passes again
    assert sup.engine_ready and "INFO engine (pid 201) watchdog passes again" in logs(back)
    sup, hung = history([*ticks(13.5, 18)], sup)  # overdue at 15, hung at 18
    assert signals(hung) == [("engine", TERM)]
    assert any("after 5 s): watchdog fails (no WATCHDOG=1 for 2 s), failing for 3.0 s" in line
               for line in logs(hung))


def test_an_engine_that_never_pings_is_hung_watchdog_plus_unhealthy_after_past_ready() -> None:
    sup, actions = history([*SERVING, *ticks(2.5, 6.5)], **WATCHDOG)
    assert not of(SignalChild, actions)
    sup, hung = history([Tick(7.0)], sup)  # ready at 2, overdue at 4, hung at 7
    assert signals(hung) == [("engine", TERM)]


def test_pings_before_ready_do_not_count() -> None:
    sup, actions = history([*SERVING[:-1], *pings(2, 30)], **WATCHDOG)
    assert not of(SignalChild, actions) and sup.phase is Phase.STARTING_ENGINE


# --------------------------------------------------------------------------- standbys


def parked(number: int = 1, t: float = 3.0) -> list[Event]:
    """Standby `number` runs as pid 300+number and parks at t+1."""
    return [Spawned("standby", None, 300 + number, t), StandbyParked(t + 1)]


def standby_pings(start: float, end: float) -> list[Event]:
    """WATCHDOG=1 from the parked standby every second, with engine pings and ticks."""
    out: list[Event] = []
    for t in range(int(start), int(end) + 1):
        out += [EngineWatchdog("standby", float(t)), EngineWatchdog("engine", float(t)),
                Tick(float(t))]
    return out


def test_a_hung_engine_is_replaced_by_the_parked_standby_once_it_is_gone() -> None:
    events = [*SERVING, *parked(), *standby_pings(4, 10), EngineWatchdog("standby", 11),
              *ticks(11, 15)]
    sup, actions = history(events, standby=True, **WATCHDOG)
    assert signals(actions) == [("engine", TERM)] and not of(PromoteStandby, actions)
    sup, gone = history([EngineWatchdog("standby", 15.5), engine_exit(1, 0, 15.6)], sup)
    assert of(PromoteStandby, gone) == [PromoteStandby()]
    assert sup.engine is not None and sup.engine.pid == 301


def test_hang_kill_after_0_kills_at_once_and_the_standby_serves_when_the_engine_is_gone(
        ) -> None:
    """--engine-hang-kill-after 0: no SIGTERM and no wait for the stop timeout; the SIGKILL
    goes with the hang, and the standby is promoted at the hung engine's exit."""
    events = [*SERVING, *parked(), *standby_pings(4, 10), EngineWatchdog("standby", 11),
              *ticks(11, 15)]
    sup, actions = history(events, standby=True, hang_kill_after=0.0, **WATCHDOG)
    assert signals(actions) == [("engine", KILL)]
    hung = next(line for line in logs(actions) if " hung, " in line)
    assert "hung, killing it (SIGKILL at once, --engine-hang-kill-after 0): watchdog fails" \
        in hung
    pinged = [e for t in ticks(15.5, 25) for e in (EngineWatchdog("standby", t.now), t)]
    sup, later = history(pinged, sup)  # past stop_timeout: no second signal
    assert not of(SignalChild, later) and not of(PromoteStandby, later)
    sup, gone = history([engine_exit(1, -9, 25.1)], sup)
    assert of(PromoteStandby, gone) == [PromoteStandby()]
    assert sup.engine is not None and sup.engine.pid == 301 and sup.engine.hangs == 1


def test_hang_kill_after_shortens_the_wait_for_the_sigkill() -> None:
    sup, hung = history([*SERVING, *health(False, 5, 8)], hang_kill_after=1.5, **HTTP)
    assert signals(hung) == [("engine", TERM)]
    assert any("hung, stopping it (SIGTERM, SIGKILL after 1.5 s): " in line
               for line in logs(hung))
    sup, waiting = history([Tick(9.4)], sup)
    assert not of(SignalChild, waiting)
    sup, killed = history([Tick(9.5)], sup)  # stop_timeout is 5: 1.5 s after the SIGTERM
    assert signals(killed) == [("engine", KILL)]
    assert "ignored SIGTERM for 1.5 s: killing it" in logs(killed)[0]


def test_a_parked_standby_that_stops_pinging_is_killed_and_replaced() -> None:
    events = [*SERVING, *parked(), *pings(4, 8)]  # the standby pinged once (parked at 4)
    sup, actions = history(events, standby=True, **WATCHDOG)
    assert signals(actions) == []
    sup, hung = history([*pings(9, 9)], sup)  # silent 5 s = watchdog 2 + unhealthy_after 3
    assert signals(hung) == [("standby", KILL)]
    assert "standby engine 1 (pid 301) hung while parked: no WATCHDOG=1 for 5.0 s" in \
        logs(hung)[0]
    sup, gone = history([ChildExited("standby", None, 301, -9, 9.1)], sup)
    assert of(SpawnStandby, gone) == [SpawnStandby(2)]
    assert logs(gone)[0] == ("WARNING standby engine 1 (pid 301) hung while parked, killed: "
                             "killed by signal 9 (SIGKILL); replacing it")
    snap = sup.snapshot()["standby"]
    assert snap["hangs"] == 1 and snap["failures"] == 0 and not snap["given_up"]


def test_a_silent_standby_is_not_promoted_the_engine_is_spawned() -> None:
    _, actions = history([*SERVING, *parked(), *pings(4, 7), engine_exit(1, 1, 7.5),
                          Tick(8.0)], standby=True, **WATCHDOG)
    assert not of(PromoteStandby, actions) and of(SpawnEngine, actions)[-1] == SpawnEngine(2)


def test_standbys_that_keep_hanging_are_given_up() -> None:
    events: list[Event] = [*SERVING]
    t = 3.0
    for n in range(1, 4):
        events += [*parked(n, t), *pings(t + 1, t + 6), ChildExited("standby", None, 300 + n,
                                                                   -9, t + 6.5)]
        t += 7
    sup, actions = history([*events, *pings(t, t + 10)], standby=True, **WATCHDOG)
    assert of(SpawnStandby, actions) == [SpawnStandby(1), SpawnStandby(2), SpawnStandby(3)]
    assert "3 parked standbys in a row hung: giving standbys up" in logs(actions)[-1]
    assert sup.snapshot()["standby"]["given_up"] and sup.snapshot()["standby"]["hangs"] == 3


# ----------------------------------------------------------------- a rank respawning


def test_a_hang_during_a_rank_respawn_restarts_the_engine_once_the_rank_serves() -> None:
    sup, actions = history([*SERVING, rank_exit(0, -9, 4), *health(False, 5, 8),
                            engine_exit(1, -15, 8.5), *ticks(9, 12)],
                           on_rank_exit="respawn", backoff_initial=0, **HTTP)
    assert of(SpawnCache, actions)[-1] == SpawnCache(0, adopt=True)
    assert signals(actions) == [("engine", TERM)]
    assert of(SpawnEngine, actions) == [SpawnEngine(1)]  # waits for rank 0
    sup, back = history([Spawned("cache", 0, 110, 12), CacheReady(0, 12.5)], sup)
    assert of(SpawnEngine, back) == [SpawnEngine(2)]


# ------------------------------------------------------------------------- config


@pytest.mark.parametrize("field", ["unhealthy_after", "engine_watchdog"])
@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf")])
def test_invalid_hang_settings(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SupervisorConfig(ranks=(0,), has_engine=True, **{field: value})


@pytest.mark.parametrize("value", [-1, -0.5, float("nan"), float("inf")])
def test_invalid_hang_kill_after(value: float) -> None:
    with pytest.raises(ValueError, match="hang_kill_after"):
        SupervisorConfig(ranks=(0,), has_engine=True, hang_kill_after=value)


def test_supervisor_runs_without_hang_settings() -> None:
    assert Supervisor(SupervisorConfig(ranks=(0,), has_engine=True)).config.unhealthy_after \
        is None


def test_the_status_surface_names_the_failing_probes_and_the_hangs() -> None:
    from pathlib import Path

    from prometheus_client import CollectorRegistry, generate_latest

    from vlaunch.launcher.health import MetricsCollector
    from vlaunch.launcher.status import format_status
    from vlaunch.launcher.statusview import merge

    sup, _ = history([*SERVING, *health(False, 5, 8), engine_exit(1, -9, 9), Tick(9.5),
                      Spawned("engine", None, 202, 9.6), EngineReady(10),
                      EngineHealth(False, 11, "liveness", "HTTP 500"), Tick(12.5)], **HTTP)
    snap = merge(sup.snapshot(), socket_dir=Path("/s"), devices={0: "cpu", 1: "cpu"},
                 details={}, launcher={})
    text = format_status(snap)
    assert "hangs 1" in text and "engine failing: liveness for 1.5 s" in text
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MetricsCollector(lambda: snap))  # type: ignore[arg-type]
    metrics = generate_latest(registry).decode()
    assert "vlaunch_engine_hangs 1.0" in metrics
    assert "vlaunch_engine_unhealthy_seconds 1.5" in metrics
    assert 'vlaunch_engine_probe_failing{probe="liveness"} 1.0' in metrics
    assert 'vlaunch_engine_probe_failing{probe="health"} 0.0' in metrics
