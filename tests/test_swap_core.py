"""Histories for the supervisor's swap decisions (core/swap.py): `vlaunch swap` and published
versions, double-buffered and in place, with and without a standby; refusals, rollbacks, a
rank's death mid-swap."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from vlaunch.cache.contract.exitcodes import ExitStatus
from vlaunch.launcher.core import Phase, SwapState
from vlaunch.launcher.core.events import (
    CacheReady,
    EngineReady,
    Event,
    PromoteStandby,
    SignalChild,
    SignalReceived,
    SpawnCache,
    Spawned,
    SpawnEngine,
    SpawnStandby,
    SwapPolicy,
    SwapRanks,
    SwapReply,
    SwapRequested,
    SwapStep,
    Tick,
)

from .test_standby_core import parked, standby_exit
from .test_supervisor_core import SERVING, engine_exit, exit_of, history, logs, of, rank_exit

TERM = signal.SIGTERM
B = "/models/b"


def ask(t: float = 10.0, **policy: Any) -> SwapRequested:
    """`vlaunch swap --model /models/b` on control connection 7."""
    return SwapRequested(7, B, SwapPolicy(**policy), t)


def answer(kind: str, t: float, version: int = 1, ranks: tuple[int, ...] = (0, 1),
           **extra: Any) -> list[Event]:
    """Every rank's answer `kind` to the step of `version`."""
    return [SwapStep(r, kind, version, t, **extra) for r in ranks]  # type: ignore[arg-type]


def hellos(pid: int, t: float, ok: bool = True, ranks: tuple[int, ...] = (0, 1),
           why: str = "") -> list[Event]:
    """Each rank's word that it answered a hello of the engine `pid` (ok: it maps them)."""
    from vlaunch.launcher.core.events import EngineWeights

    return [EngineWeights(r, pid, ok, why, t) for r in ranks]


def steps(actions: list) -> list[str]:
    """The swap steps sent to the ranks, in order."""
    return [a.step for a in of(SwapRanks, actions)]


def final(actions: list) -> SwapReply:
    """The one final reply to the requester."""
    [reply] = [r for r in of(SwapReply, actions) if r.final]
    return reply


def engine_terms(actions: list) -> int:
    """How many SIGTERMs went to the engine."""
    return sum(1 for s in of(SignalChild, actions) if s.role == "engine" and s.sig == TERM)


def test_double_buffered_stages_and_commits_while_the_old_engine_serves() -> None:
    sup, actions = history([*SERVING, ask(), *answer("prepared", 11, fits=True),
                            *answer("staged", 12)])
    assert steps(actions) == ["prepare", "stage", "commit"]
    assert of(SwapRanks, actions)[0] == SwapRanks("prepare", 1, model=B, mode="auto",
                                                  policy=SwapPolicy())
    assert of(SwapRanks, actions)[1].mode == "double"
    assert engine_terms(actions) == 0 and sup.phase is Phase.SERVING  # A serves meanwhile
    assert not final_replies(actions)
    sup, more = history([*answer("committed", 13)], sup)
    assert engine_terms(more) == 1 and sup.phase is Phase.RESTARTING  # cut over: the old goes
    sup, more = history([engine_exit(1, 0, 14.0)], sup)
    assert of(SpawnEngine, more) == [SpawnEngine(2)]
    sup, more = history([Spawned("engine", None, 202, 14.5), EngineReady(15.0), *hellos(202, 15.1)],
                        sup)
    assert steps(more) == ["finish"] and final(more).status == 0
    swap = sup.snapshot()["swap"]
    assert swap["state"] == "none" and swap["version"] == 1 and swap["model"] == B
    assert swap["swaps"] == 1 and swap["mode"] == "double"
    assert sup.engine is not None and sup.engine.restarts == 1


def final_replies(actions: list) -> list[SwapReply]:
    return [r for r in of(SwapReply, actions) if r.final]


def test_auto_picks_in_place_when_a_device_has_no_room_and_stops_the_engine_first() -> None:
    sup, actions = history([*SERVING, ask(), SwapStep(0, "prepared", 1, 11, fits=True),
                            SwapStep(1, "prepared", 1, 11, fits=False), *answer("staged", 12)])
    assert steps(actions) == ["prepare", "stage"]  # no commit while the engine maps A
    assert of(SwapRanks, actions)[1].mode == "in-place" and engine_terms(actions) == 1
    assert "a device has no room for both" in "\n".join(logs(actions))
    sup, more = history([engine_exit(1, 0, 13.0)], sup)
    assert steps(more) == ["commit"] and not of(SpawnEngine, more)
    sup, more = history([*answer("committed", 14)], sup)
    assert of(SpawnEngine, more) == [SpawnEngine(2)]
    sup, more = history([Spawned("engine", None, 202, 15), EngineReady(15), Tick(17)], sup)
    assert final(more).status == 0 and sup.snapshot()["swap"]["mode"] == "in-place"


def test_in_place_with_a_standby_parks_one_before_its_weights_then_promotes_it() -> None:
    sup, actions = history([*SERVING, *parked(1), ask(t=10, mode="in-place"),
                            *answer("prepared", 11), *answer("staged", 12)], standby=True)
    # standby 1 maps the old weights (a lease): it goes before anything is overwritten
    assert ("standby", TERM) in [(s.role, s.sig) for s in of(SignalChild, actions)]
    assert engine_terms(actions) == 0
    sup, more = history([standby_exit(1, 0, 13.0)], sup)
    assert of(SpawnStandby, more) == [SpawnStandby(2, next_weights=True)]
    sup, more = history([*parked(2, 14.0)], sup)
    assert engine_terms(more) == 1  # parked: now the old engine goes
    sup, more = history([engine_exit(1, 0, 16.0)], sup)
    assert steps(more) == ["commit"]
    sup, more = history([*answer("committed", 17)], sup)
    assert of(PromoteStandby, more) == [PromoteStandby()] and not of(SpawnEngine, more)
    sup, more = history([EngineReady(18), Tick(20)], sup)
    assert final(more).status == 0 and steps(more) == ["finish"]
    assert of(SpawnStandby, more) == [SpawnStandby(3)]  # an ordinary standby again
    assert sup.snapshot()["standby"]["failures"] == 0  # the retired standby was no failure


def test_double_with_a_standby_promotes_one_parked_on_the_new_weights_never_the_old() -> None:
    sup, actions = history([*SERVING, *parked(1), ask(), *answer("prepared", 11, fits=True),
                            *answer("staged", 12), *answer("committed", 13)], standby=True)
    assert engine_terms(actions) == 0  # the old engine serves until the new standby parks
    sup, more = history([engine_exit(1, -9, 13.5)], sup)  # it crashes meanwhile
    # the parked standby 1 holds the old weights: never promoted; the engine starts fresh
    assert not of(PromoteStandby, more) and of(SpawnEngine, more) == [SpawnEngine(2)]


def test_double_with_a_standby_waits_for_the_new_one_to_park() -> None:
    sup, actions = history([*SERVING, *parked(1), ask(), *answer("prepared", 11, fits=True),
                            *answer("staged", 12), *answer("committed", 13),
                            standby_exit(1, 0, 13.2)], standby=True)
    assert of(SpawnStandby, actions)[-1] == SpawnStandby(2)
    sup, more = history([*parked(2, 14.0)], sup)
    assert engine_terms(more) == 1
    sup, more = history([engine_exit(1, 0, 15.0)], sup)
    assert of(PromoteStandby, more) == [PromoteStandby()]
    sup, more = history([EngineReady(15.2), Tick(17.2)], sup)
    assert final(more).status == 0


@pytest.mark.parametrize("step", ["prepared", "staged"])
def test_a_refusal_before_the_cutover_leaves_the_old_engine_serving(step: str) -> None:
    events: list[Event] = [*SERVING, ask()]
    if step == "staged":
        events += answer("prepared", 11, fits=True)
    events += [SwapStep(0, step, 1, 12),  # type: ignore[arg-type]
               SwapStep(1, "refused", 1, 12, status=int(ExitStatus.BAD_PLAN),
                        message="other architecture")]
    sup, actions = history(events)
    assert steps(actions)[-1] == "abort" and engine_terms(actions) == 0
    reply = final(actions)
    assert reply.status == ExitStatus.BAD_PLAN and "other architecture" in reply.message
    assert "version 0 keeps serving" in reply.message
    assert sup.phase is Phase.SERVING and sup.snapshot()["swap"]["version"] == 0
    # a late answer of the abandoned swap changes nothing; the next swap may begin
    sup, more = history([SwapStep(0, "staged", 1, 13), ask(t=14)], sup)
    assert steps(more) == ["prepare"]


def test_a_second_swap_or_one_while_not_serving_is_unavailable() -> None:
    _, actions = history([*SERVING, ask(), ask(t=11)])
    assert final(actions).status == ExitStatus.SWAP_UNAVAILABLE
    assert "another swap (to version 1) is in progress" in final(actions).message
    _sup, actions = history([*SERVING, engine_exit(1, 1, 5.0), ask(t=5.1)])
    assert final(actions).status == ExitStatus.SWAP_UNAVAILABLE
    assert "not serving (phase restarting)" in final(actions).message
    _, actions = history([*SERVING, rank_exit(1, -9, 5.0), ask(t=5.1)], on_rank_exit="respawn")
    assert "cache rank(s) 1 are not ready (respawning)" in final(actions).message


def in_place_new_engine(**policy: Any) -> list[Event]:
    """An in-place swap up to the new engine's spawn (attempt 2, pid 202)."""
    return [*SERVING, ask(mode="in-place", **policy), *answer("prepared", 11),
            *answer("staged", 12), engine_exit(1, 0, 13), *answer("committed", 14),
            Spawned("engine", None, 202, 14)]


def test_a_new_engine_that_keeps_crashing_is_rolled_back() -> None:
    sup, actions = history([*in_place_new_engine(attempts=2), engine_exit(2, 1, 15),
                            Tick(16), Spawned("engine", None, 203, 16), engine_exit(3, 1, 17)])
    assert steps(actions)[-1] == "rollback" and not final_replies(actions)
    sup, more = history([*answer("rolled_back", 18)], sup)
    reply = final(more)
    assert reply.status == ExitStatus.SWAP_ROLLED_BACK and reply.version == 0
    assert "exited 2 time(s) before it was ready" in reply.message
    assert of(SpawnEngine, more) == [SpawnEngine(4)]  # back on the old weights
    assert sup.snapshot()["swap"]["rollbacks"] == 1 and sup.snapshot()["swap"]["version"] == 0


def test_a_configuration_error_of_the_new_engine_rolls_back_at_once() -> None:
    sup, actions = history([*in_place_new_engine(), engine_exit(2, 78, 15)])
    assert steps(actions)[-1] == "rollback"
    assert sup.exit_status is None  # not 81: the old weights are restored instead


def test_a_new_engine_past_its_ready_timeout_is_stopped_then_rolled_back() -> None:
    sup, actions = history([*in_place_new_engine(ready_timeout=5), Tick(18), Tick(20)])
    assert engine_terms(actions[-3:]) == 1 and steps(actions)[-1] == "commit"
    sup, more = history([engine_exit(2, 0, 21)], sup)
    assert steps(more) == ["rollback"]


def test_on_failure_stop_stops_the_launcher_with_86() -> None:
    _sup, actions = history([*in_place_new_engine(on_failure="stop", attempts=1),
                            engine_exit(2, 1, 15), rank_exit(0, 0, 16), rank_exit(1, 0, 16)])
    assert final(actions).status == ExitStatus.SWAP_FAILED
    assert exit_of(actions).status == ExitStatus.SWAP_FAILED


def test_a_rank_killed_while_staging_abandons_the_swap_and_respawns_as_usual() -> None:
    sup, actions = history([*SERVING, ask(), *answer("prepared", 11, fits=True),
                            rank_exit(1, -9, 12)], on_rank_exit="respawn")
    assert final(actions).status == ExitStatus.SWAP_UNAVAILABLE
    assert steps(actions)[-1] == "abort" and SpawnCache(1, adopt=True) in actions
    assert sup.exit_status is None and engine_terms(actions) == 0


def test_a_rank_killed_after_the_cutover_began_stops_the_launcher_even_with_respawn() -> None:
    _sup, actions = history([*SERVING, ask(mode="in-place"), *answer("prepared", 11),
                            *answer("staged", 12), engine_exit(1, 0, 13),
                            SwapStep(0, "committed", 1, 14), rank_exit(1, -9, 14.5),
                            rank_exit(0, 0, 15)], on_rank_exit="respawn")
    assert final(actions).status == ExitStatus.SWAP_FAILED
    assert not of(SpawnCache, actions[-6:]) and exit_of(actions).status == ExitStatus.RANK_EXITED
    assert not of(SpawnEngine, actions[-6:])  # nothing ever serves the mix


def test_a_commit_refused_in_place_rolls_the_committed_ranks_back_and_restarts_on_a() -> None:
    sup, actions = history([*SERVING, ask(mode="in-place"), *answer("prepared", 11),
                            *answer("staged", 12), engine_exit(1, 0, 13),
                            SwapStep(0, "committed", 1, 14),
                            SwapStep(1, "refused", 1, 14, status=87,
                                     message="pid 4242 still maps the old weights")])
    assert steps(actions)[-1] == "rollback" and not of(SpawnEngine, actions[-4:])
    sup, more = history([*answer("rolled_back", 15)], sup)
    assert final(more).status == ExitStatus.SWAP_ROLLED_BACK
    assert "pid 4242 still maps the old weights" in final(more).message
    assert of(SpawnEngine, more) == [SpawnEngine(2)]


def test_a_double_commit_refused_keeps_the_old_engine_serving() -> None:
    sup, actions = history([*SERVING, ask(), *answer("prepared", 11, fits=True),
                            *answer("staged", 12), SwapStep(0, "committed", 1, 13),
                            SwapStep(1, "refused", 1, 13, status=67, message="changed"),
                            *answer("rolled_back", 14)])
    assert engine_terms(actions) == 0 and not of(SpawnEngine, actions[-5:])
    assert "version 0 keeps serving" in final(actions).message
    assert sup.phase is Phase.SERVING


def test_the_old_engine_crashing_during_a_double_commit_starts_on_the_new_weights() -> None:
    sup, actions = history([*SERVING, ask(), *answer("prepared", 11, fits=True),
                            *answer("staged", 12), engine_exit(1, -9, 12.5), Tick(20)])
    assert not of(SpawnEngine, actions[-3:])  # not while the ranks cut over
    sup, more = history([*answer("committed", 21)], sup)
    assert of(SpawnEngine, more) == [SpawnEngine(2)]


def test_a_stop_ends_the_swap_with_86_and_sighup_waits() -> None:
    sup, actions = history([*SERVING, ask(), SignalReceived(signal.SIGHUP, 11)])
    assert "SIGHUP ignored: a swap is in progress" in "\n".join(logs(actions))
    sup, actions = history([SignalReceived(TERM, 12)], sup)
    assert final(actions).status == ExitStatus.SWAP_FAILED
    assert "the launcher is stopping" in final(actions).message


def test_a_published_version_cuts_over_once_every_rank_committed_it() -> None:
    sup, actions = history([*SERVING, SwapStep(0, "published", 0, 10, label="step-7",
                                               mode="double")])
    assert not of(SwapRanks, actions) and sup.snapshot()["swap"]["state"] == "staging"
    sup, more = history([SwapStep(1, "published", 0, 11, label="step-7", mode="double")], sup)
    assert of(SwapRanks, more) == [SwapRanks("commit", 1, mode="double",
                                             policy=SwapPolicy(mode="double"))]
    sup, more = history([*answer("committed", 12), engine_exit(1, 0, 13),
                         Spawned("engine", None, 202, 13), EngineReady(14), Tick(16)], sup)
    assert steps(more) == ["finish"]
    swap = sup.snapshot()["swap"]
    assert swap["label"] == "step-7" and swap["version"] == 1 and swap["model"] == ""


def test_a_published_version_missing_on_a_rank_or_in_another_mode_is_refused() -> None:
    _, actions = history([*SERVING, SwapStep(0, "published", 0, 10, label="x",
                                               mode="double"), Tick(10 + 121)])
    assert steps(actions) == ["abort"] and "rank(s) 1 did not commit" in final(actions).message
    _sup, actions = history([*SERVING, SwapStep(0, "published", 0, 10, label="x", mode="double"),
                            SwapStep(1, "published", 0, 10, label="x", mode="in-place")])
    assert steps(actions) == ["abort"] and "with the same mode" in final(actions).message


def test_a_caches_only_launcher_swaps_the_ranks_alone() -> None:
    sup, actions = history([*SERVING[:5], ask(), *answer("prepared", 11),
                            *answer("staged", 12), *answer("committed", 13)],
                           has_engine=False)
    assert steps(actions) == ["prepare", "stage", "commit", "finish"]
    assert final(actions).status == 0 and sup.snapshot()["swap"]["state"] == "none"


def test_status_line_and_snapshot_show_the_swap() -> None:
    sup, _ = history([*SERVING, ask()])
    assert sup.snapshot()["swap"]["state"] == SwapState.PREPARING.value
    assert sup.snapshot()["swap"]["target_model"] == B
    assert "swapping to version 1 (preparing)" in sup._status_line()
    sup, _ = history([CacheReady(0, 11)], sup)  # unrelated events do not disturb it
    assert sup.snapshot()["swap"]["target_version"] == 1


def test_an_in_place_swap_a_rank_cannot_make_is_refused_before_the_engine_stops() -> None:
    why = "it cannot tell which processes still map its slabs (adopted)"
    for policy, fits in (({"mode": "in-place"}, True), ({}, False)):
        _, actions = history([*SERVING, ask(**policy), SwapStep(0, "prepared", 1, 11,
                                                                   fits=fits),
                                SwapStep(1, "prepared", 1, 11, fits=fits, in_place=why)])
        assert steps(actions) == ["prepare", "abort"] and engine_terms(actions) == 0
        reply = final(actions)
        assert reply.status == ExitStatus.SWAP_UNAVAILABLE
        assert f"rank 1 cannot swap in place: {why}" in reply.message
        assert "version 0 keeps serving" in reply.message
    # the same blocker does not matter to a double swap
    _, actions = history([*SERVING, ask(), *answer("prepared", 11, fits=True, in_place=why)])
    assert steps(actions) == ["prepare", "stage"]


@pytest.mark.parametrize("on_failure", ["rollback", "stop"])
def test_a_new_engine_a_rank_refused_its_weights_is_no_finished_swap(on_failure: str) -> None:
    from vlaunch.launcher.core.events import EngineWeights

    sup, _ = history([*SERVING, ask(on_failure=on_failure), *answer("prepared", 11, fits=True),
                      *answer("staged", 12), *answer("committed", 13), engine_exit(1, 0, 14),
                      Spawned("engine", None, 202, 14.5),
                      EngineWeights(0, 202, True, "", 14.6),
                      EngineWeights(1, 202, False, "fingerprint mismatch: checkpoint_data", 14.7),
                      EngineWeights(1, 999, True, "", 14.8)])  # another process: not counted
    assert sup.snapshot()["engine"]["weights"] == {
        "0": "cache", "1": "not the cache: fingerprint mismatch: checkpoint_data"}
    sup, more = history([EngineReady(15)], sup)
    assert "finish" not in steps(more)
    if on_failure == "stop":
        assert final(more).status == ExitStatus.SWAP_FAILED
        return
    assert engine_terms(more) == 1  # the new engine goes, then the ranks roll back
    sup, more = history([engine_exit(2, 0, 16)], sup)
    assert steps(more) == ["rollback"]
    sup, more = history([*answer("rolled_back", 17)], sup)
    reply = final(more)
    assert reply.status == ExitStatus.SWAP_ROLLED_BACK
    assert "not on the new weights from the caches: cache rank 1 refused them (fingerprint " \
           "mismatch: checkpoint_data)" in reply.message


def test_a_ready_new_engine_waits_for_every_ranks_word_on_its_hello() -> None:
    """The ranks tell the launcher of a hello on their ready channels, which can arrive after
    the engine's READY=1: the swap ends once every swapped rank has spoken (done, or rolled
    back when one refused), or HELLO_WAIT after the engine was ready (an engine that never
    asks the caches)."""
    from vlaunch.launcher.core.swap import HELLO_WAIT

    def ready() -> Any:
        return history([*SERVING, ask(), *answer("prepared", 11, fits=True),
                        *answer("staged", 12), *answer("committed", 13), engine_exit(1, 0, 14),
                        Spawned("engine", None, 202, 14.5), EngineReady(15)])

    sup, actions = ready()
    assert not final_replies(actions) and "finish" not in steps(actions)
    sup, more = history(hellos(202, 15.1, ranks=(0,)), sup)
    assert not final_replies(more)  # rank 1 has not spoken yet
    sup, more = history(hellos(202, 15.2, ranks=(1,)), sup)
    assert steps(more) == ["finish"] and final(more).status == 0
    # a refusal that arrives after READY=1 still rolls the swap back (the race CI met)
    sup, _ = ready()
    sup, more = history(hellos(202, 15.3, ok=False, why="fingerprint mismatch: x"), sup)
    assert "finish" not in steps(more) and engine_terms(more) == 1
    # no word at all: done once HELLO_WAIT has passed, not before
    sup, _ = ready()
    sup, more = history([Tick(15 + HELLO_WAIT / 2)], sup)
    assert not final_replies(more)
    sup, more = history([Tick(15 + HELLO_WAIT)], sup)
    assert steps(more) == ["finish"] and final(more).status == 0

