"""Histories for draining (core/drain.py): with the launcher holding the engine's sockets, an
engine replaced on purpose gives way to its parked standby first, then drains."""

from __future__ import annotations

import math
import signal

from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.launcher.core import Phase
from vlaunch.launcher.core.events import (
    ChildExited,
    EngineReady,
    PromoteStandby,
    RetireEngine,
    SignalChild,
    SignalDraining,
    SignalReceived,
    Spawned,
    SpawnEngine,
    Tick,
)

from .test_standby_core import parked
from .test_supervisor_core import SERVING, engine_exit, exit_of, history, logs, of, rank_exit
from .test_swap_core import answer, ask, engine_terms, final

TERM, KILL = signal.SIGTERM, signal.SIGKILL
LISTENING = {"standby": True, "listening": True, "drain_timeout": 5.0}


def drain_exit(pid: int, status: int, t: float) -> ChildExited:
    """The draining engine `pid` exited."""
    return ChildExited("draining", None, pid, status, t)


def ordered(actions: list) -> list[str]:
    """The retire, promote and drain-signal actions, in their order."""
    names = {RetireEngine: "retire", PromoteStandby: "promote", SignalDraining: "drain"}
    return [names[type(a)] for a in actions if type(a) in names]


def test_sighup_with_a_parked_standby_promotes_first_then_drains_the_old_engine() -> None:
    sup, actions = history([*SERVING, *parked(1), SignalReceived(signal.SIGHUP, 10.0)],
                           **LISTENING)
    assert ordered(actions) == ["retire", "promote", "drain"]
    assert of(RetireEngine, actions) == [RetireEngine(201)]
    assert of(SignalDraining, actions) == [SignalDraining(201, TERM)]
    assert engine_terms(actions) == 0  # the old engine is no longer "the engine"
    assert sup.engine is not None and sup.engine.pid == 301
    assert sup.snapshot()["drain"] == {"drained": 0, "killed": 0, "draining": 1}
    # the promoted standby serves; the drained engine exits on its own: nothing restarts
    sup, more = history([EngineReady(10.2), drain_exit(201, 0, 10.5)], sup)
    assert sup.phase is Phase.SERVING and not of(SpawnEngine, more)
    assert sup.snapshot()["drain"] == {"drained": 1, "killed": 0, "draining": 0}
    assert "engine (pid 201) drained" in " ".join(logs(more))


def test_without_the_launchers_socket_sighup_stops_the_engine_first() -> None:
    sup, actions = history([*SERVING, *parked(1), SignalReceived(signal.SIGHUP, 10.0)],
                           standby=True)
    assert not of(RetireEngine, actions) and engine_terms(actions) == 1
    assert "drain" not in sup.snapshot()


def test_a_drain_past_its_timeout_is_killed_once_and_counted() -> None:
    sup, actions = history([*SERVING, *parked(1), SignalReceived(signal.SIGHUP, 10.0),
                            EngineReady(10.2), Tick(14.9)], **LISTENING)
    assert SignalDraining(201, KILL) not in actions
    sup, more = history([Tick(15.0), Tick(15.1)], sup)
    assert of(SignalDraining, more) == [SignalDraining(201, KILL)]
    assert "did not finish its requests within 5 s (--drain-timeout)" in " ".join(logs(more))
    sup, more = history([drain_exit(201, -9, 15.2)], sup)
    assert sup.snapshot()["drain"] == {"drained": 0, "killed": 1, "draining": 0}
    assert "killed after its drain timeout" in " ".join(logs(more))


def test_drain_timeout_defaults_to_the_stop_timeout() -> None:
    sup, _ = history([*SERVING, *parked(1), SignalReceived(signal.SIGHUP, 10.0)],
                     standby=True, listening=True, stop_timeout=7.0)
    assert not of(SignalDraining, history([Tick(16.9)], sup)[1])
    assert SignalDraining(201, KILL) in history([Tick(17.0)], sup)[1]


def test_a_double_swap_promotes_the_standby_parked_on_the_new_weights_then_drains() -> None:
    sup, actions = history([*SERVING, *parked(1), ask(), *answer("prepared", 11, fits=True),
                            *answer("staged", 12), *answer("committed", 13),
                            ChildExited("standby", None, 301, 0, 13.2)], **LISTENING)
    # standby 1 (old weights) was retired; standby 2 parks on the new ones
    assert not of(PromoteStandby, actions) and engine_terms(actions) == 0
    sup, more = history(parked(2, 14.0), sup)
    assert ordered(more) == ["retire", "promote", "drain"]
    assert of(SignalDraining, more) == [SignalDraining(201, TERM)]
    sup, more = history([EngineReady(15.2), Tick(17.2)], sup)
    assert final(more).status == 0  # done while the old engine may still drain
    sup, more = history([drain_exit(201, 0, 15.5)], sup)
    assert not of(SpawnEngine, more) and sup.snapshot()["drain"]["drained"] == 1


def test_an_in_place_swap_cannot_overlap_the_old_engine_drains_before_the_copy() -> None:
    sup, actions = history([*SERVING, *parked(1), ask(mode="in-place"),
                            *answer("prepared", 11), *answer("staged", 12)], **LISTENING)
    assert not of(RetireEngine, actions)
    sup, more = history([ChildExited("standby", None, 301, 0, 12.5),  # the old one retired
                         *parked(2, 13.0)], sup)  # the new standby parks before its weights
    assert engine_terms(more) == 1 and not of(RetireEngine, more)
    # its SIGKILL comes after drain_timeout, not stop_timeout
    kills = [s for s in of(SignalChild, history([Tick(18.9), Tick(19.0)], sup)[1])
             if s.sig == KILL]
    assert kills == [SignalChild("engine", None, KILL)]


def test_a_stop_waits_for_the_draining_engine_and_kills_it_with_the_rest() -> None:
    sup, _ = history([*SERVING, *parked(1), SignalReceived(signal.SIGHUP, 10.0),
                      EngineReady(10.2), Spawned("standby", None, 302, 10.3),
                      SignalReceived(signal.SIGTERM, 11.0)], **LISTENING)
    sup, more = history([ChildExited("engine", None, 301, 0, 11.1),  # the promoted standby
                         ChildExited("standby", None, 302, 0, 11.15),
                         rank_exit(0, 0, 11.2), rank_exit(1, 0, 11.3)], sup)
    assert not [a for a in more if type(a).__name__ == "Exit"]  # pid 201 still drains
    assert "the draining engine (pid 201)" in " ".join(sup._live_children())
    sup, more = history([drain_exit(201, 0, 11.5)], sup)
    assert exit_of(more).status == ExitStatus.OK


def test_an_exit_that_arrives_as_the_engines_before_its_retiral_is_the_drains() -> None:
    sup, _ = history([*SERVING, *parked(1), SignalReceived(signal.SIGHUP, 10.0)], **LISTENING)
    sup, more = history([engine_exit(1, 0, 10.1)], sup)  # reaped as "engine"
    assert sup.snapshot()["drain"]["draining"] == 0 and not of(SpawnEngine, more)
    assert sup._draining == {} and math.isfinite(sup.config.stop_timeout)


def test_a_rollback_drains_the_new_engine_within_the_drain_timeout() -> None:
    """A ready new engine stopped for a rollback is replaced on purpose: SIGTERM, then
    SIGKILL after --drain-timeout (not --stop-timeout), then the ranks roll back."""
    from vlaunch.launcher.core.events import EngineWeights

    from .test_swap_core import steps

    sup, _ = history([*SERVING, ask(), *answer("prepared", 11, fits=True),
                      *answer("staged", 12), *answer("committed", 13), engine_exit(1, 0, 14),
                      Spawned("engine", None, 202, 14.5),
                      EngineWeights(0, 202, True, "", 14.6),
                      EngineWeights(1, 202, False, "fingerprint mismatch: checkpoint_data",
                                    14.7)],
                     listening=True, drain_timeout=5.0, stop_timeout=30.0)
    sup, more = history([EngineReady(15)], sup)
    assert engine_terms(more) == 1
    sup, more = history([Tick(19.9)], sup)
    assert SignalChild("engine", None, KILL) not in more
    sup, more = history([Tick(20.0), Tick(20.1)], sup)
    assert more.count(SignalChild("engine", None, KILL)) == 1
    assert "ignored SIGTERM for 5 s" in " ".join(logs(more))
    sup, more = history([engine_exit(2, -9, 20.2)], sup)
    assert steps(more) == ["rollback"]
