"""Swapping the weights (`vlaunch swap`, or a version a trainer published): every rank
prepares, stages and commits the new weights; the old engine stops and the new one starts on
them (or a standby is promoted); then the ranks drop the old weights, or roll back to them.
The states and their order are `SwapState`'s table (model.py); docs/swap.md is the operator's
side.

The old weights are never touched before every rank has staged the new ones, and no engine
runs while the ranks hold a mix: an in-place copy happens with the engine gone, and a rank
that exits once a cutover began stops the launcher.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vlaunch.cache.contract.exitcodes import ExitStatus

from .events import (
    Action,
    ChildExited,
    EngineWeights,
    Log,
    Notify,
    SwapPolicy,
    SwapRanks,
    SwapReply,
    SwapRequested,
    SwapStep,
)
from .model import (
    ENGINE_ALIVE,
    SWAP_NEXT,
    EngineState,
    Phase,
    RankState,
    StandbyState,
    SwapState,
    SwapStatus,
    moved,
)
from .state import SupervisorState

S = SwapState
CUTTING_OVER = "cutting over"
"""The progress answer's message once the ranks are asked to cut over (control.CUTTING_OVER:
the core imports nothing of the wire's)."""
PUBLISH_WAIT = 120.0
"""Seconds every swapped rank has to commit a published version once the first one did."""
HELLO_WAIT = 2.0
"""Seconds a swap's ready new engine waits for every swapped rank's word on its hello (the
ranks tell it on their ready channels, which can arrive after the engine's READY=1); then
the swap is done on what was heard (an engine that never asks the caches is not checked)."""
_ANSWERS = {S.PREPARING: "prepared", S.STAGING: "staged", S.COMMITTING: "committed",
            S.ROLLING_BACK: "rolled_back"}
"""The answer each waiting state expects from every rank."""


class SwapDecisions(SupervisorState):
    """What a swap request and each rank's answer mean, and a swap's part in the engine's,
    the standby's and the ranks' events."""

    # --------------------------------------------------------------------- requests

    def _on_swap_requested(self, e: SwapRequested) -> list[Action]:
        """Begin a swap to `e.model`, or refuse it (87) while another runs or not serving."""
        busy = self._swap_unavailable()
        if busy:
            why = f"swap to {e.model} refused: {busy}"
            return [Log("WARNING", why), SwapReply(e.request, True,
                                                   int(ExitStatus.SWAP_UNAVAILABLE), why,
                                                   self._swap.version)]
        version = self._swap.version + 1
        self._begin_swap(e.request, e.policy, version, e.model, "", S.PREPARING)
        return [Log("INFO", f"swap to version {version} ({e.model}): preparing"),
                SwapReply(e.request, False, 0, "preparing", version),
                SwapRanks("prepare", version, model=e.model, mode=e.policy.mode,
                          policy=e.policy), self._swap_notify()]

    def _swap_unavailable(self) -> str:
        """Why no swap can begin now ("" when one can)."""
        sw = self._swap
        if sw.state is not S.NONE:
            return (f"another swap (to version {sw.target_version}) is in progress; wait until "
                    "it ends (vlaunch status) and try again")
        if self._stop is not None or self.phase is not Phase.SERVING:
            return (f"the launcher is not serving (phase {self.phase.value}); a swap starts "
                    "only while it serves: try again once it does")
        if not self.caches_ready:
            waiting = ", ".join(str(r.rank) for r in self._ranks.values()
                                if r.state is not RankState.READY)
            return (f"cache rank(s) {waiting} are not ready (respawning); try again once "
                    "every rank serves")
        return ""

    def _begin_swap(self, request: int, policy: SwapPolicy, version: int, model: str,
                    label: str, state: SwapState) -> None:
        """Record a new swap's target and forget the last one's bookkeeping."""
        self._swap_run.request, self._swap_run.policy = request, policy
        self._swap_run.waiting = set(self._swap_ranks())
        self._swap_run.answered, self._swap_run.fits, self._swap_run.refusal = set(), True, None
        self._swap_run.no_in_place = {}
        self._swap_run.deadline, self._swap_run.engine_gone = None, False
        self._swap_run.rollback_sent = self._swap_run.new_engine = False
        self._swap_to(state, target_version=version, target_model=model, target_label=label,
                      mode="" if policy.mode == "auto" else policy.mode, failures=0)

    def _swap_to(self, state: SwapState, **changes: Any) -> SwapStatus:
        """Move the swap to `state` (along SWAP_NEXT), with `changes` to its record."""
        sw = self._swap
        self._swap = replace(sw, state=moved(SWAP_NEXT, sw.state, state, "swap"), **changes)
        return self._swap

    def _on_swap_step(self, e: SwapStep) -> list[Action]:
        """A rank's answer to the pending step; the last one moves the swap on."""
        if e.answer == "published":
            return self._swap_published(e)
        sw = self._swap
        if sw.state is S.NONE or e.version != sw.target_version or \
                e.rank not in self._swap_run.waiting:
            return []  # a late answer to an abandoned swap, or a repeat
        if e.answer == "refused":
            return self._swap_refused(e)
        if _ANSWERS.get(sw.state) != e.answer or (sw.state is S.ROLLING_BACK
                                                  and not self._swap_run.rollback_sent):
            return []
        self._swap_run.waiting.discard(e.rank)
        self._swap_run.fits = self._swap_run.fits and (e.fits or e.answer != "prepared")
        if e.answer == "prepared" and e.in_place:
            self._swap_run.no_in_place[e.rank] = e.in_place
        if e.answer == "committed":
            self._swap_run.answered.add(e.rank)
        if self._swap_run.waiting:
            return []
        step = {"prepared": self._swap_prepared_all, "staged": self._swap_staged_all,
                "committed": self._swap_committed_all,
                "rolled_back": self._swap_rolled_back_all}[e.answer]
        return step(e.now)

    def _swap_published(self, e: SwapStep) -> list[Action]:
        """A trainer committed a version on one rank: the swap begins (staged already) once
        every rank has it, within PUBLISH_WAIT."""
        sw = self._swap
        if sw.state is S.STAGING and self._swap_run.request == 0 and sw.target_label == e.label \
                and e.rank in self._swap_run.waiting:
            if e.mode != sw.mode:
                return self._swap_abort(ExitStatus.SWAP_UNAVAILABLE, (
                    f"rank {e.rank} staged the published version {e.label!r} for an {e.mode} "
                    f"swap, an earlier rank for {sw.mode}; publish with the same mode on "
                    "every rank"))
            self._swap_run.waiting.discard(e.rank)
            return self._swap_if_staged(e.now)
        busy = self._swap_unavailable()
        if busy:
            why = f"published version {e.label!r} of rank {e.rank} refused: {busy}"
            return [Log("WARNING", why), SwapRanks("abort", 0, ranks=(e.rank,),
                                                   status=int(ExitStatus.SWAP_UNAVAILABLE),
                                                   message=why)]
        version = sw.version + 1
        self._begin_swap(0, SwapPolicy(mode=e.mode), version, sw.model, e.label, S.STAGING)
        self._swap_run.waiting.discard(e.rank)
        self._swap_run.deadline = e.now + PUBLISH_WAIT
        return [Log("INFO", f"rank {e.rank}: version {version} published ({e.label!r}, "
                            f"{e.mode}); waiting for every rank's"),
                *self._swap_if_staged(e.now)]

    # ------------------------------------------------------------------------ steps

    def _swap_prepared_all(self, now: float) -> list[Action]:
        """Every rank checked the new weights: pick the mode and stage them."""
        sw, policy = self._swap, self._swap_run.policy
        fits = self._swap_run.fits
        mode = policy.mode if policy.mode != "auto" else "double" if fits else "in-place"
        if mode == "in-place" and self._swap_run.no_in_place:
            return self._swap_abort(ExitStatus.SWAP_UNAVAILABLE, self._swap_in_place_refused())
        why = "" if policy.mode != "auto" else \
            " (every device has room for both)" if fits else " (a device has no room for both)"
        self._swap_to(S.STAGING, mode=mode)
        self._swap_run.waiting = set(self._swap_ranks())
        return [Log("INFO", f"swap to version {sw.target_version}: staging the new weights, "
                            f"{mode}{why}"),
                SwapRanks("stage", sw.target_version, mode=mode), self._swap_notify()]

    def _swap_in_place_refused(self) -> str:
        """Why an in-place swap is refused before anything stops: a rank said it could not
        cut over in place (its commit would wait --lease-wait with the engine gone, then roll
        back)."""
        rank, why = min(self._swap_run.no_in_place.items())
        room = "" if self._swap_run.policy.mode == "in-place" else \
            " (every device needs room for both shards)"
        return (f"rank {rank} cannot swap in place: {why}; an in-place swap would stop the "
                "engine, then find the slabs held and roll back: swap double-buffered "
                f"(--mode double{room}), or restart the launcher (a fresh load follows who "
                "maps its slabs)")

    def _swap_if_staged(self, now: float) -> list[Action]:
        """A published version: go on once every rank has staged it."""
        return [] if self._swap_run.waiting else self._swap_staged_all(now)

    def _swap_staged_all(self, now: float) -> list[Action]:
        """Every rank holds the new weights beside the old: cut over (double), or get the
        engine out of the way first (in-place)."""
        self._swap_run.deadline = None
        if self._swap.mode == "double" or self._engine is None:
            return self._swap_commit(now)
        actions, parking = self._swap_clear_standby(now, next_weights=True, park=True)
        return actions if parking else [*actions, *self._swap_stop_engine(now)]

    def _swap_commit(self, now: float) -> list[Action]:
        """Ask every rank to cut over."""
        sw = self._swap
        self._swap_to(S.COMMITTING)
        self._swap_run.waiting, self._swap_run.answered = set(self._swap_ranks()), set()
        self._swap_run.deadline = now + self._swap_run.policy.ready_timeout
        self._cancel_restart()  # no start mid-commit
        # the requester hears it (not final): should the launcher die from now on, the
        # ranks may hold the new weights (vlaunch swap says so)
        return [Log("INFO", f"swap to version {sw.target_version}: cutting over ({sw.mode})"),
                SwapRanks("commit", sw.target_version, mode=sw.mode, policy=self._swap_run.policy),
                SwapReply(self._swap_run.request, False, 0, CUTTING_OVER, sw.target_version,
                          sw.mode), self._swap_notify()]

    def _swap_committed_all(self, now: float) -> list[Action]:
        """Every rank serves the new weights (double: the old engine still maps the old
        ones): start the new engine, once the old one is gone and, with a standby, once one
        parked on the new weights."""
        self._swap_run.deadline = None
        engine = self._engine
        if engine is None:
            return self._swap_finish(now)
        if self._swap.mode == "in-place":
            return self._swap_start_engine(now)
        ready = engine.state is EngineState.READY
        actions, parking = self._swap_clear_standby(now, next_weights=False, park=ready)
        if parking:
            return actions
        if engine.state in ENGINE_ALIVE:
            return [*actions, *self._swap_stop_engine(now)]
        return [*actions, *self._swap_start_engine(now)]

    def _swap_clear_standby(self, now: float, *, next_weights: bool, park: bool
                            ) -> tuple[list[Action], bool]:
        """Retire a standby started for the old weights; with `park` (and the swap's standby
        on), wait for a new one to park (for in-place, one that parks before its weights):
        (actions, whether the swap now waits for it)."""
        sb = self._standby
        if sb is None or sb.given_up:
            return [], False
        wait = park and self._swap_run.policy.standby
        self._hold_standbys(next_weights=next_weights, paused=not wait)
        actions: list[Action] = []
        if sb.state in (StandbyState.STARTING, StandbyState.PARKED):
            actions = [Log("INFO", f"stopping standby engine {sb.number} (pid {sb.pid}): it "
                                   "was started for the old weights"), *self._retire_standby()]
        if not wait:
            return actions, False
        self._swap_to(S.PARKING)
        before = " before it maps them" if next_weights else ""
        return [Log("INFO", f"swap to version {self._swap.target_version}: a standby engine "
                            f"parks on the new weights{before}"), *actions,
                *(self._spawn_standby(now) if sb.state is StandbyState.NONE else []),
                self._swap_notify()], True

    def _swap_standby_parked(self, now: float) -> list[Action]:
        """A standby for the new weights parked (one started for the old ones was retired,
        and a retired one's PARKED=1 is never heard): the old engine may go."""
        if self._swap.state is S.PARKING:
            if self._swap.mode == "double" and self._can_overlap():
                return self._swap_overlap(now)
            return self._swap_stop_engine(now)
        return []

    def _swap_overlap(self, now: float) -> list[Action]:
        """Double buffering on the launcher's sockets (drain.py): the standby parked on the
        new weights is promoted while the old engine drains."""
        sw = self._swap
        self._swap_to(S.STARTING)
        self._swap_run.deadline = now + self._swap_run.policy.ready_timeout
        self._swap_run.new_engine = True
        self._hold_standbys(next_weights=False)
        return [Notify({**self._reloading_field(), "STATUS": self._status_line()}),
                *self._promote_then_drain(now, f"swap to version {sw.target_version}")]

    def _swap_stop_engine(self, now: float) -> list[Action]:
        """SIGTERM the serving engine (SIGKILL after drain_timeout); go on once it is gone."""
        sw, engine = self._swap, self._require_engine()
        self._swap_to(S.STOPPING)
        if engine.state in (EngineState.STARTING, EngineState.READY):
            sigterm = self._engine_sigterm(now + self._drain_grace())
            return [Log("INFO", f"swap to version {sw.target_version}: stopping the engine "
                                f"(pid {engine.pid})"),
                    Notify({**self._reloading_field(), "STATUS": self._status_line()}),
                    *sigterm]
        if engine.state is EngineState.STOPPING:
            return []  # its exit moves the swap on
        self._cancel_restart()
        return self._swap_engine_stopped(now)

    def _swap_engine_stopped(self, now: float) -> list[Action]:
        """The old engine is gone: start the new one (double), or copy (in-place)."""
        if self._swap.mode == "double":
            return self._swap_start_engine(now)
        return self._swap_commit(now)

    def _swap_start_engine(self, now: float) -> list[Action]:
        """Start the engine on the new weights (promote a standby that parked for them)."""
        sw = self._swap
        self._swap_to(S.STARTING)
        self._swap_run.deadline = now + self._swap_run.policy.ready_timeout
        self._swap_run.new_engine = True
        self._hold_standbys(next_weights=False)
        if self._engine is None:
            return self._swap_finish(now)
        return [Log("INFO", f"swap to version {sw.target_version}: starting the engine on the "
                            "new weights"), *self._spawn_engine()]

    def _swap_engine_ready(self, now: float) -> list[Action]:
        """The engine is ready: in the starting step, the swap is done, unless a rank refused
        it the new weights (it serves what it loaded elsewhere: the disk)."""
        if self._swap.state is not S.STARTING:
            return []
        self._swap_run.ready_at = now
        return self._swap_if_weights_heard(now)

    def _swap_if_weights_heard(self, now: float) -> list[Action]:
        """The ready new engine's swap ends once every swapped rank answered its hello (or
        HELLO_WAIT passed): rolled back if one refused it the new weights, else done."""
        refused = self._weights_refused()
        if refused:
            rank, why = refused
            return self._swap_give_up(now, (
                f"the new engine is ready, but not on the new weights from the caches: cache "
                f"rank {rank} refused them ({why}), so it serves what it loaded elsewhere (the "
                "disk)"))
        engine, run = self._engine, self._swap_run
        heard = run.weights_seen.get(engine.pid or 0, {}) if engine is not None else {}
        if set(self._swap_ranks()) - set(heard) and now < (run.ready_at or now) + HELLO_WAIT:
            return []  # _on_engine_weights or _swap_tick comes back here
        return self._swap_finish(now)

    def _weights_refused(self) -> tuple[int, str] | None:
        """The first rank that refused the engine its weights, and why (None: none did)."""
        engine = self._engine
        seen = self._swap_run.weights_seen.get(engine.pid or 0, {}) if engine is not None else {}
        return next(((r, why) for r, why in sorted(seen.items()) if why), None)

    def _on_engine_weights(self, e: EngineWeights) -> list[Action]:
        """A rank answered a hello of the engine's or the standby's: note whether it maps the
        weights from the caches (`/status` engine.weights; a swap's check above)."""
        engine, sb = self._engine, self._standby
        ours = {p for p in (engine.pid if engine else None, sb.pid if sb else None) if p}
        run = self._swap_run
        run.weights_seen = {p: v for p, v in run.weights_seen.items() if p in ours}
        if e.pid not in ours:
            return []
        run.weights_seen.setdefault(e.pid, {})[e.rank] = "" if e.ok else e.why[:400]
        acts: list[Action] = []
        if not e.ok:
            who = "the standby" if sb is not None and e.pid == sb.pid else "the engine"
            acts.append(Log("WARNING", f"cache rank {e.rank} refused its weights to {who} "
                                       f"(pid {e.pid}): {e.why[:400]}; it loads them from "
                                       "elsewhere (the disk) or exits"))
        if self._swap.state is S.STARTING and run.ready_at is not None and engine is not None \
                and e.pid == engine.pid:
            acts += self._swap_if_weights_heard(e.now)
        return acts

    def _swap_finish(self, now: float) -> list[Action]:
        """The new weights serve: the ranks drop the old ones."""
        sw = self._swap
        what = f"version {sw.target_version} ({sw.target_label or sw.target_model})"
        message = f"swap done: {what} serves ({sw.mode})"
        return [Log("INFO", message), SwapRanks("finish", sw.target_version),
                *self._swap_end(0, message)]

    def _swap_end(self, status: int, message: str, *, rolled_back: bool = False
                  ) -> list[Action]:
        """The swap is over (status 0: the new weights serve): answer, forget its state."""
        sw = self._swap
        ok = status == 0
        self._swap_to(
            S.NONE, version=sw.target_version if ok else sw.version,
            model=sw.target_model if ok else sw.model, label=sw.target_label if ok
            else sw.label, swaps=sw.swaps + ok, rollbacks=sw.rollbacks + rolled_back,
            last=message)
        self._swap_run.deadline, self._swap_run.waiting = None, set()
        self._swap_run.ready_at = None
        self._hold_standbys(next_weights=False, paused=False)
        standby = self._spawn_standby(self._now) if ok or rolled_back else []
        return [SwapReply(self._swap_run.request, True, status, message, self._swap.version,
                          sw.mode), *standby, self._swap_notify()]

    # --------------------------------------------------------------------- failures

    def _swap_refused(self, e: SwapStep) -> list[Action]:
        """A rank refused a step: abandon (nothing touched yet), or roll back."""
        sw = self._swap
        why = f"cache rank {e.rank} refused: {e.message}"
        if sw.state in (S.PREPARING, S.STAGING):
            known = e.status in {int(s) for s in ExitStatus}
            return self._swap_abort(ExitStatus(e.status) if known else ExitStatus.INTERNAL, why)
        if sw.state is S.COMMITTING:
            self._swap_run.waiting.discard(e.rank)
            run = self._swap_run
            run.refusal = run.refusal or (int(ExitStatus.SWAP_ROLLED_BACK), why)
            if self._swap_run.waiting:
                return [Log("ERROR", f"swap to version {sw.target_version}: {why}")]
            return self._swap_roll_back(e.now, self._swap_run.refusal[1])
        what = (f"swap to version {sw.target_version}: {why} during the rollback; stopping: "
                "the ranks may hold different versions")
        return [Log("ERROR", what), *self._swap_end(int(ExitStatus.SWAP_FAILED), what),
                *self._begin_stop(ExitStatus.SWAP_FAILED, what, e.now)]

    def _swap_abort(self, status: ExitStatus, why: str) -> list[Action]:
        """Abandon a swap before any cutover: the ranks drop what they staged."""
        sw = self._swap
        message = f"swap to version {sw.target_version} refused: {why}; version {sw.version} " \
                  "keeps serving"
        return [Log("ERROR", message), SwapRanks("abort", sw.target_version, status=int(status),
                                                 message=message),
                *self._swap_end(int(status), message)]

    def _swap_give_up(self, now: float, why: str) -> list[Action]:
        """The new engine will not be ready: roll back, or stop (--on-failure stop)."""
        sw = self._swap
        if self._swap_run.policy.on_failure == "stop":
            what = f"swap to version {sw.target_version} failed: {why}; stopping (on-failure stop)"
            return [Log("ERROR", what), *self._swap_end(int(ExitStatus.SWAP_FAILED), what),
                    *self._begin_stop(ExitStatus.SWAP_FAILED, what, now)]
        return self._swap_roll_back(now, why)

    def _swap_roll_back(self, now: float, why: str) -> list[Action]:
        """Stop the new engine (if it runs), then have every rank restore the old weights."""
        sw = self._swap
        self._swap_run.refusal = self._swap_run.refusal or (int(ExitStatus.SWAP_ROLLED_BACK), why)
        self._swap_to(S.ROLLING_BACK)
        self._swap_run.deadline = now + self._swap_run.policy.ready_timeout
        self._swap_run.rollback_sent = False
        actions: list[Action] = [Log("WARNING", f"swap to version {sw.target_version}: rolling "
                                                f"back to version {sw.version}: {why}")]
        actions += self._retire_standby()
        self._hold_standbys(next_weights=False, paused=True)
        engine = self._engine
        if engine is not None and self._swap_run.new_engine and engine.state in (
                EngineState.STARTING, EngineState.READY):
            # replaced on purpose: it drains what it holds (--drain-timeout), then goes
            return [*actions, *self._engine_sigterm(now + self._drain_grace())]
        if engine is not None and engine.state is EngineState.STOPPING:
            return actions  # its exit sends the rollback
        if engine is not None and engine.state is EngineState.BACKOFF:
            self._cancel_restart()
        return [*actions, *self._swap_send_rollback()]

    def _swap_send_rollback(self) -> list[Action]:
        """Ask every rank to restore the old weights (a rank that did not commit drops what it
        staged)."""
        sw = self._swap
        self._swap_run.rollback_sent = True
        self._swap_run.waiting = set(self._swap_ranks())
        status, why = self._swap_run.refusal or (int(ExitStatus.SWAP_ROLLED_BACK), "")
        return [SwapRanks("rollback", sw.target_version, mode=sw.mode, status=status,
                          message=why), self._swap_notify()]

    def _swap_rolled_back_all(self, now: float) -> list[Action]:
        """The old weights are back on every rank: the engine serves them again."""
        sw = self._swap
        status, why = self._swap_run.refusal or (int(ExitStatus.SWAP_ROLLED_BACK), "")
        alive = self._engine_alive()
        again = "keeps serving" if alive else "serves again"
        message = f"swap to version {sw.target_version} rolled back: {why}; version " \
                  f"{sw.version} {again}"
        actions: list[Action] = [Log("WARNING", message),
                                 *self._swap_end(status, message, rolled_back=True)]
        if self._engine is not None and not alive:
            actions += self._spawn_engine()
        return actions

    # ------------------------------------------------------- the swap's part elsewhere

    def _swap_engine_exited(self, e: ChildExited, what: str) -> list[Action] | None:
        """An engine exit while a swap cuts over, decided here (None: decided as usual)."""
        sw = self._swap
        if sw.state in (S.NONE, S.PREPARING, S.STAGING):
            return None
        self._forget_reload()
        if sw.state in (S.STOPPING, S.PARKING):
            word = "stopped for the swap" if sw.state is S.STOPPING else \
                "before the standby parked"
            return [Log("INFO" if sw.state is S.STOPPING else "WARNING", f"{what} ({word})"),
                    *self._swap_engine_stopped(e.now)]
        if sw.state is S.STARTING:
            return self._swap_new_engine_exited(e, what)
        if sw.state is S.ROLLING_BACK and not self._swap_run.rollback_sent:
            return [Log("INFO", what), *self._swap_send_rollback()]
        self._swap_run.engine_gone = True  # committing, or rolling back: start once that is done
        return [Log("WARNING", f"{what}; it starts again once every rank has answered")]

    def _swap_new_engine_exited(self, e: ChildExited, what: str) -> list[Action]:
        """The new engine exited before it was ready: restart it, or give up after
        `attempts` exits (at once for a configuration error)."""
        sw = self._swap = replace(self._swap, failures=self._swap.failures + 1)
        attempts = self._swap_run.policy.attempts
        if e.status in self.config.engine_config_error_statuses:
            return [Log("ERROR", what), *self._swap_give_up(
                e.now, f"the new engine exited with {e.status}, a configuration error")]
        if sw.failures >= attempts:
            return [Log("ERROR", what), *self._swap_give_up(
                e.now, f"the new engine exited {sw.failures} time(s) before it was ready "
                       "(--attempts)")]
        return self._schedule_restart(f"{what} (on the new weights)", e.now)

    def _swap_rank_exited(self, rank: int, e: ChildExited) -> tuple[list[Action], bool]:
        """A swapped rank exited: abandon a swap still staging; past that, (.., True): the
        launcher stops whatever on_rank_exit says (its slabs may be half cut over)."""
        sw = self._swap
        if sw.state is S.NONE or rank not in self._swap_ranks():
            return [], False
        what = f"cache rank {rank} (pid {e.pid}) exited during the swap to version " \
               f"{sw.target_version}"
        if sw.state in (S.PREPARING, S.STAGING):
            return self._swap_abort(ExitStatus.SWAP_UNAVAILABLE, f"{what}, before any cutover"), \
                False
        why = f"{what}, after its cutover began: stopping (the ranks may hold different versions)"
        return [Log("ERROR", why), *self._swap_end(int(ExitStatus.SWAP_FAILED), why)], True

    def _swap_stopped(self, reason: str) -> list[Action]:
        """A stop began: any swap ends (86)."""
        if self._swap.state is S.NONE:
            return []
        return self._swap_end(int(ExitStatus.SWAP_FAILED), f"the swap to version "
                              f"{self._swap.target_version} ended: the launcher is stopping "
                              f"({reason})")

    def _swap_tick(self, now: float) -> list[Action]:
        """A standby that will not park (given up), and the swap's deadlines."""
        sw = self._swap
        if sw.state is S.PARKING and (self._standby is None or self._standby.given_up):
            return [Log("WARNING", "standbys were given up: the swap goes on without one"),
                    *self._swap_stop_engine(now)]
        if sw.state is S.STARTING and self._swap_run.ready_at is not None:
            return self._swap_if_weights_heard(now)
        if self._swap_run.deadline is None or now < self._swap_run.deadline:
            return []
        self._swap_run.deadline = None
        limit = self._swap_run.policy.ready_timeout
        if sw.state is S.STAGING:
            late = ", ".join(map(str, sorted(self._swap_run.waiting)))
            return self._swap_abort(ExitStatus.SWAP_UNAVAILABLE, (
                f"rank(s) {late} did not commit the published version {sw.target_label!r} "
                f"within {PUBLISH_WAIT:g} s of the first"))
        if sw.state is S.STARTING:
            return self._swap_give_up(now, f"the new engine was not ready within {limit:g} s "
                                           "(--ready-timeout)")
        what = (f"swap to version {sw.target_version}: the ranks did not finish the "
                f"{sw.state.value.replace('_', ' ')} step within {limit:g} s; stopping")
        return [Log("ERROR", what), *self._swap_end(int(ExitStatus.SWAP_FAILED), what),
                *self._begin_stop(ExitStatus.SWAP_FAILED, what, now)]

    def _swap_notify(self) -> Notify:
        """STATUS= with the swap's step."""
        return Notify({"STATUS": self._status_line()})
