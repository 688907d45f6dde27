"""``rearrange="when_it_pays"``: the controller's decision at every window close.

EPLB exists to make the busiest rank's step shorter. A move costs serving time (weights staged,
exchanged and installed while steps run) and pays back only in later steps, and only while the
load it was planned for lasts. So at every window close, identically on every rank (every input
is a sum from the window reduction), :meth:`PaybackGate.decide` reads top-down:

1. **evidence.** Fit the expert cost model from the serving samples
   (:class:`~eplb_graph.control.cost_model.ExpertCostModel`); take the window's load per step
   as served (to judge what ran) and with its noise shrunk away (to plan), and what the ranks
   measured (:func:`~eplb_graph.control.evidence.read_window`).
2. **what ran.** Every placement that has served keeps what it measured, per load it served
   (:class:`~eplb_graph.control.calibration.Calibrations`). So the gate can say what a
   placement it has served under a load like this one takes, and what any other placement
   would take (the model, scaled as the committed placement measured against it): placements
   are compared on the same load, and a change of traffic is never read as a good or a bad
   plan. The newest move is credited with what it saved against the placement before it under
   this load, and the price of a copy is learnt from the moves so far
   (:class:`~eplb_graph.control.moves.MoveLedger`); a window far off the committed placement's
   own calibration (a host stall: :data:`~eplb_graph.control.calibration.DISTURBED`) does neither.
3. **never slower than where it came from.** The committed placement is set against the
   engine's starting placement (what EPLB off serves) and, after a forward move, the placement
   before it (where that one was measured under a load like this one; a step back is not undone
   by another). Slower than either by more than :data:`BACK_TOLERANCE` under the served load, the
   gate goes back: to that placement, or to a candidate predicted :data:`CLEARLY_FASTER`, even if
   going back does not repay its copies within one interval. A placement measured slower stays
   so while the load is like the one it was measured under; under another it may be right
   again. Where no placement could beat the start by :data:`MIN_SAVING`, a placement predicted
   slower than the start (left over from another load) goes toward it: by the fewest moves that
   make it predicted as fast (:func:`~eplb_graph.policy.incremental.reach_by_moves`), where
   they repay their copies within the interval as any move must (a prediction sends them).
4. **what could be better.** The candidates: the configured policy's plan, the placement
   packed by predicted time (:func:`~eplb_graph.policy.predicted_time.pack_by_predicted_time`),
   the few priced moves from the committed placement that repay the most
   (:func:`~eplb_graph.policy.incremental.improve_by_moves`) and the starting placement. Each
   is predicted under the planned load.
5. **whether it pays.** A candidate may be applied only if predicted to cut the step by at
   least :data:`MIN_SAVING` and its predicted saving over the next interval, discounted by the
   share of their predicted savings that past moves realized
   (:meth:`~eplb_graph.control.moves.MoveLedger.realized`), exceeds its copies times the price of
   a copy; of those, the largest net gain wins (not the fastest: three times the copies for the
   last few percent does not pay).

Two shortcuts keep a window cheap where nothing can repay a move (planning runs on the cores
that serve, and holds the interpreter the serving thread needs): before any candidate is built,
the committed placement's predicted time is set against a floor no placement beats
(:func:`~eplb_graph.control.cost_model.lower_bound_step_us`): where even the floor is within
:data:`MIN_SAVING` of it, or would not repay one copy, no candidate could be applied (an even
load: the drift benchmark's mixed and uniform phases priced 30-35-copy plans every window for
nothing); and a window like the last one whose candidates were all priced and refused (same
placement, price and a saving bound not grown much:
:class:`~eplb_graph.control.refusal.RefusalMemory`) is refused on its word, a few times in a row.
Neither applies when the gate must go back.

A window whose deciding fails (a bug, a policy error) keeps the placement and is recorded as
``failed`` with its cause; the next window decides afresh. Every decision is kept (newest
:data:`KEPT`) with its figures, and so is every window's check of the model against what the
ranks measured (``accuracy``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from eplb_graph.control.calibration import Calibrations, load_shares
from eplb_graph.control.cost_model import ExpertCostModel, lower_bound_step_us, predict_rank_us
from eplb_graph.control.evidence import Evidence, check_prediction, read_window
from eplb_graph.control.gate_snapshot import gate_snapshot
from eplb_graph.control.moves import MoveLedger
from eplb_graph.control.refusal import RefusalMemory
from eplb_graph.control.tolerances import (
    BACK_TOLERANCE,
    CANNOT_TELL,
    CLEARLY_FASTER,
    HOME,
    MIN_SAVING,
    SLOWER,
)
from eplb_graph.control.window import WindowLoad
from eplb_graph.policy.incremental import improve_by_moves, reach_by_moves
from eplb_graph.policy.predicted_time import pack_by_predicted_time
from eplb_graph.policy.preserve import preserve_slots, relabel_ranks, transfers_needed

__all__ = ["PaybackGate"]

KEPT = 16
PolicyPlan = torch.Tensor | Callable[[], torch.Tensor | None] | None
"""The configured policy's candidate: a plan, a callable making it on demand, or none."""


@dataclass(frozen=True)
class _Back:
    """Where to go back to: its name, itself, its calibrated µs per step under the planned load."""

    name: str
    placement: torch.Tensor
    bound_us: float
    reason: str = SLOWER


@dataclass
class PaybackGate:
    """The decision maker of ``rearrange="when_it_pays"`` (see the module docstring).

    Args:
        num_ranks, num_slots: the cluster shape.
        max_replicas: lookup width ``R`` (no candidate gives an expert more copies).
        step_interval: steps between window closes: the horizon a plan must repay within.
        min_gain_percent: additionally, the predicted busiest-rank time must fall by this share.
        copy_bytes: bytes of one expert copy (the prior and the floor of a copy's price).
    """

    num_ranks: int
    num_slots: int
    max_replicas: int
    step_interval: int
    min_gain_percent: int = 0
    copy_bytes: int = 0
    model: ExpertCostModel | None = None
    decisions: deque = field(default_factory=lambda: deque(maxlen=KEPT))
    counts: dict = field(
        default_factory=lambda: {"applied": 0, "kept": 0, "rollbacks": 0, "failed": 0}
    )
    predicted_rank_ms: list | None = None
    measured_rank_ms: list | None = None
    accuracy: deque = field(default_factory=lambda: deque(maxlen=KEPT))
    published: dict | None = None
    ledger: MoveLedger = field(init=False)
    copy_source: str = "prior"
    _initial: torch.Tensor | None = None
    _calibrations: Calibrations = field(init=False)
    _shares: torch.Tensor | None = None
    _refusals: RefusalMemory = field(default_factory=RefusalMemory)
    copy_us: float = field(default=0.0, init=False)
    """The price of one copy the last window set (µs)."""

    def __post_init__(self) -> None:
        self.ledger = MoveLedger(self.copy_bytes)
        self._calibrations = Calibrations(self._step_us)
        self.step_interval = max(1, int(self.step_interval))

    # -- the decision ----------------------------------------------------------------------------
    def decide(self, load: WindowLoad, policy_plan: PolicyPlan) -> torch.Tensor | None:
        """The placement to move to, or ``None`` to keep the committed one. ``policy_plan``: the
        configured policy's plan, or a callable making it (called only if some placement could
        repay a move), or ``None``. Never raises: a failure keeps the placement, recorded."""
        try:
            return self._decide(load, policy_plan)
        except Exception as error:
            self.failed(load.step, error)
            return None
        finally:
            # One immutable document per decision: the metrics writer's thread reads it.
            self.published = self.snapshot()

    def failed(self, step: int, error: BaseException) -> None:
        """Record a window whose deciding failed (the placement is kept)."""
        self.counts["failed"] += 1
        self._record(step, "failed", f"{type(error).__name__}: {error}")

    def _decide(self, load: WindowLoad, policy_plan: PolicyPlan) -> torch.Tensor | None:
        evidence = self._evidence(load)
        if isinstance(evidence, str):
            return self._keep(load.step, evidence)
        committed = evidence.committed
        self._learn(evidence)
        model = evidence.model
        self.copy_us, self.copy_source = self.ledger.copy_us(max(model.read_us, model.row_us))
        evidence.copy_us = self.copy_us
        back = self._must_go_back(evidence)
        bound = None if back is None else back.bound_us
        ratio = self._ratio(committed)
        now = self._step_us(committed, evidence.planned) * ratio
        realized = self.ledger.realized()
        figures = {
            **evidence.figures(),
            "predicted_step_ms_now": now / 1e3,
            "horizon_steps": self.step_interval,
            "copy_ms": evidence.copy_us / 1e3,
            "realized_share": realized,
        }
        if bound is None:
            floor = self._floor_us(evidence) * ratio
            figures["saving_bound_ms_per_step"] = max(0.0, now - floor) / 1e3
            if (now - floor) * realized * self.step_interval <= evidence.copy_us:
                return self._keep(evidence.step, "no placement can repay a move", **figures)
            if now - floor < now * self._least_saving():
                return self._keep(evidence.step, CANNOT_TELL, **figures)
            if self._refusals.answers(committed, evidence.copy_us, now - floor):
                return self._keep(
                    evidence.step,
                    "nothing repaid when last priced, and the saving bound has not grown",
                    priced_at_step=self._refusals.last.step,
                    **figures,
                )
        if callable(policy_plan):
            policy_plan = policy_plan()
        return self._choose(evidence, self._candidates(evidence, policy_plan, back), now, back)

    # -- 1. evidence -----------------------------------------------------------------------------
    def _evidence(self, load: WindowLoad) -> Evidence | str:
        """What the window tells (:func:`~eplb_graph.control.evidence.read_window`), or why it
        tells nothing to decide on; checks the model's prediction against the measurement."""
        if self._initial is None:
            self._initial = load.committed.clone()
        self._calibrations.window += 1
        self.model, evidence = read_window(load, self.model, self.num_ranks)
        if isinstance(evidence, str):
            return evidence
        self._shares = load_shares(evidence.served)
        self.ledger.movement_cost(evidence.movement_cost_us)
        check = check_prediction(evidence, self._initial, self.num_ranks)
        self.predicted_rank_ms, self.measured_rank_ms = check.predicted_ms, check.measured_ms
        if check.entry is not None:
            self.accuracy.append(check.entry)
        return evidence

    # -- 2. what ran -----------------------------------------------------------------------------
    def _learn(self, evidence: Evidence) -> None:
        """Calibrate the committed placement on what it measured, and credit the newest move
        with its saving against the placement before it, both under this window's load; neither
        where the window was disturbed (:data:`~eplb_graph.control.calibration.DISTURBED`)."""
        measured = evidence.measured_step_us
        if measured is None:
            return
        committed, served = evidence.committed, evidence.served
        predicted = self._step_us(committed, served)
        if predicted <= 0:
            return
        measurement = self._calibrations.measure(committed, served, self._shares, measured)
        evidence.against_calibration = measurement.against_calibration
        evidence.disturbed = measurement.disturbed
        if measurement.disturbed:
            return  # it says what the host did, not what the placement takes or the move saved
        move = self.ledger.newest()
        if move is not None and torch.equal(move.plan, committed):
            # The placement before the move, under this load: measured, if it served a load
            # like this one; else the model with the committed placement's calibration (then
            # the move's saving is the model's word, and so is what it promised).
            ratio = self._ratio(move.before, committed)
            before = self._step_us(move.before, served) * ratio
            promised = before - predicted * ratio
            self.ledger.credit(committed, before - measured, promised, self.step_interval)

    def _ratio(self, placement: torch.Tensor, committed: torch.Tensor | None = None) -> float:
        """Measured over predicted for ``placement`` under a load like this window's; if not
        measured so, the ``committed`` one's, else the newest calibration's, else 1."""
        for candidate in (placement, committed):
            if candidate is not None:
                calibration = self._calibrations.find(candidate, self._shares)
                ratio = None if calibration is None else self._calibrations.ratio(calibration)
                if ratio is not None:
                    return ratio
        latest = self._calibrations.latest()
        return 1.0 if latest is None else latest

    # -- 3. never slower than where it came from ---------------------------------------------
    def _must_go_back(self, evidence: Evidence) -> _Back | None:
        """Where to go back to when the committed placement is slower, under the served load,
        than the start or the one before the last forward move; ``None`` when it is not. At the
        start there is nothing to go back from (on the drift benchmark the start, measured once
        5% slower than the placement it came back from, sent the gate there again: 33 copies)."""
        committed, served = evidence.committed, evidence.served
        if torch.equal(committed, self._initial):
            return None
        now = self._step_us(committed, served) * self._ratio(committed)
        references = {"initial": self._initial}
        move = self.ledger.newest()
        if (
            move is not None
            and not move.back
            and torch.equal(move.plan, committed)
            and self._calibrations.find(move.before, self._shares) is not None
        ):
            # Judged where the placement before it was measured under a load like this one
            # (else pricing decides); a step back is not undone by one (noise: to and fro).
            references["previous"] = move.before
        slower_than = {
            name: reference
            for name, reference in references.items()
            if not torch.equal(reference, committed)
            and now > (1 + BACK_TOLERANCE) * self._step_us(reference, served)
            * self._ratio(reference)
        }  # fmt: skip
        if not slower_than:
            return self._toward_start(evidence) if self._nothing_beats_the_start(evidence) else None
        times = {
            name: self._step_us(reference, evidence.planned) * self._ratio(reference)
            for name, reference in slower_than.items()
        }
        name = min(times, key=lambda n: (times[n], n))
        return _Back(name, slower_than[name], times[name])

    def _toward_start(self, evidence: Evidence) -> _Back:
        """The fewest moves that make each layer predicted as fast as the start's
        (:func:`~eplb_graph.policy.incremental.reach_by_moves`: a prediction is all that sends
        it, so a new placement predicted as fast is as good), or the start itself where those,
        calibrated, are not."""
        planned, initial = evidence.planned, self._initial
        start_us = self._step_us(initial, planned) * self._ratio(initial)
        near = reach_by_moves(evidence.committed, planned, initial, self.num_ranks,
                              self.max_replicas, evidence.model)  # fmt: skip
        near_us = self._step_us(near, planned) * self._ratio(near, evidence.committed)
        if torch.equal(near, initial) or near_us > start_us * (1 + 1e-9):
            return _Back("initial", initial, start_us, HOME)
        return _Back("toward_initial", near, start_us, HOME)

    def _nothing_beats_the_start(self, evidence: Evidence) -> bool:
        """Whether the committed placement is predicted slower than the start while none could
        beat the start by :data:`MIN_SAVING` (a leftover from another load gains nothing there),
        unless a step toward the start reached it under a load like this one: what differs since
        is the load's noise (drift benchmark: 3 steps, on differences of 1.1, 0.2, 0.6%)."""
        committed, planned = evidence.committed, evidence.planned
        if self.ledger.stepped_back_to(committed, self._shares, HOME):
            return False
        start = self._step_us(self._initial, planned) * self._ratio(self._initial)
        now = self._step_us(committed, planned) * self._ratio(committed)
        if now <= start:
            return False
        return self._floor_us(evidence) * self._ratio(committed) >= start * (1 - MIN_SAVING)

    # -- 4. what could be better ---------------------------------------------------------------
    def _candidates(
        self, evidence: Evidence, policy_plan, back: _Back | None
    ) -> dict[str, torch.Tensor]:
        """The policy's plan, the packing by predicted time, the priced moves and the starting
        placement; going back, also the placement it goes back to."""
        if back is not None and back.reason == HOME:
            # Nothing beats the start by MIN_SAVING (the floor says so): no other could be taken.
            return {back.name: back.placement}
        committed, planned, model = evidence.committed, evidence.planned, evidence.model
        packed = pack_by_predicted_time(
            planned, self.num_slots, self.num_ranks, self.max_replicas, model
        )
        packed = preserve_slots(committed, relabel_ranks(committed, packed, self.num_ranks),
                                self.num_ranks)  # fmt: skip
        candidates = {
            "predicted_time": packed,
            "fewest_moves": improve_by_moves(
                committed, planned, self.num_ranks, self.max_replicas, model,
                evidence.copy_us, self.step_interval,
            ),
            "initial": self._initial,
        }  # fmt: skip
        if back is not None:
            candidates[back.name] = back.placement
        if policy_plan is not None:
            candidates["policy"] = policy_plan
        return candidates

    # -- 5. whether it pays ----------------------------------------------------------------------
    def _choose(
        self,
        evidence: Evidence,
        candidates: dict[str, torch.Tensor],
        now: float,
        back: _Back | None,
    ) -> torch.Tensor | None:
        committed = evidence.committed
        start = self._step_us(self._initial, evidence.planned) * self._ratio(self._initial)
        figures = {
            name: {**evidence.figures(), "predicted_step_ms_initial": start / 1e3,
                   **self._figures(evidence, plan, now)}
            for name, plan in candidates.items()
        }  # fmt: skip
        reasons = {
            name: self._refusal(evidence, name, plan, figures[name], now, back)
            for name, plan in candidates.items()
        }
        eligible = [name for name in candidates if reasons[name] is None]
        if not eligible:
            if back is not None and back.reason == HOME:
                return self._keep(evidence.step, reasons[back.name], candidate=back.name,
                                  **figures[back.name])  # fmt: skip
            if back is not None:
                return self._keep(
                    evidence.step, "slower than before, and no candidate is faster",
                    **figures["initial"],
                )  # fmt: skip
            # Report the faster candidate that came closest to repaying (the fastest when none
            # is faster than the committed placement).
            faster = [n for n in candidates if figures[n]["saving_ms_per_step"] > 0]
            name = (
                max(faster, key=lambda n: (figures[n]["net_ms"], n))
                if faster
                else min(candidates, key=lambda n: (figures[n]["predicted_step_ms_plan"], n))
            )
            if reasons[name] == "the saving does not repay the move":
                bound_us = (now - self._floor_us(evidence) * self._ratio(committed)) * (
                    self.ledger.realized()
                )
                self._refusals.remember(evidence.step, committed, evidence.copy_us, bound_us)
            return self._keep(evidence.step, reasons[name], candidate=name, **figures[name])
        name = max(eligible, key=lambda n: (figures[n]["net_ms"], n == "policy", n))
        plan, chosen = candidates[name], figures[name]
        self._refusals.last = None
        self.ledger.applied(
            evidence.step, name, committed.clone(), plan.clone(), chosen["copies"],
            chosen["saving_ms_per_step"] * 1e3, None if back is None else back.reason,
            self._shares,
        )  # fmt: skip
        if back is not None:
            self.counts["rollbacks"] += 1
            self._record(evidence.step, "rollback", back.reason, candidate=name, **chosen)
        else:
            self.counts["applied"] += 1
            self._record(evidence.step, "applied", "predicted to repay its move",
                         candidate=name, **chosen)  # fmt: skip
        return plan

    def _figures(self, evidence: Evidence, plan: torch.Tensor, now: float) -> dict[str, Any]:
        """A candidate's predicted step (calibrated: each placement by what it measured when it
        served, a new one by the committed placement's), saving, copies, cost and net gain over
        the horizon."""
        predicted = self._step_us(plan, evidence.planned) * self._ratio(plan, evidence.committed)
        copies = int(transfers_needed(evidence.committed, plan, self.num_ranks).sum())
        cost = copies * evidence.copy_us
        realized = self.ledger.realized()
        expected = (now - predicted) * realized
        return {
            "predicted_step_ms_now": now / 1e3,
            "predicted_step_ms_plan": predicted / 1e3,
            "saving_ms_per_step": (now - predicted) / 1e3,
            "horizon_steps": self.step_interval,
            "copies": copies,
            "cost_ms": cost / 1e3,
            "realized_share": realized,
            "net_ms": (expected * self.step_interval - cost) / 1e3,
        }

    def _refusal(
        self,
        evidence: Evidence,
        name: str,
        plan: torch.Tensor,
        figures: dict,
        now: float,
        back: _Back | None,
    ) -> str | None:
        """Why a candidate must not be applied, or ``None`` if it may."""
        saving = figures["saving_ms_per_step"] * 1e3
        if torch.equal(plan, evidence.committed) or saving <= 0:
            return "no placement is predicted faster"
        if back is not None:
            # Going back: to the placement it goes back to, or one predicted clearly faster.
            predicted = figures["predicted_step_ms_plan"] * 1e3
            if name != back.name and predicted > back.bound_us * (1 - CLEARLY_FASTER):
                return "not clearly faster than where it came from"
            if back.reason == HOME and figures["net_ms"] <= 0:
                # A prediction sends it (within the model's error): it must repay like any move.
                return "the saving does not repay the move"
            return None
        if saving < now * self._least_saving():
            return "predicted saving too small to tell from noise"
        if figures["net_ms"] <= 0:
            return "the saving does not repay the move"
        return None

    # -- the shortcuts ---------------------------------------------------------------------------
    def _least_saving(self) -> float:
        """The share of the step a plan must save: :data:`MIN_SAVING` or ``min_gain_percent``."""
        return max(MIN_SAVING, self.min_gain_percent / 100)

    def _floor_us(self, evidence: Evidence) -> float:
        """The least any placement is predicted to take under the planned load (uncalibrated)."""
        if evidence.floor_us is None:
            evidence.floor_us = lower_bound_step_us(
                evidence.planned, self.num_ranks, evidence.model, self.num_slots,
                self.max_replicas,
            )  # fmt: skip
        return evidence.floor_us

    # -- predictions -----------------------------------------------------------------------------
    def _step_us(self, phy2log: torch.Tensor, per_step: torch.Tensor) -> float:
        """Predicted expert µs of one step: each layer waits for its busiest rank."""
        ranks = predict_rank_us(phy2log, per_step, self.num_ranks, self.model)
        return float(ranks.max(axis=1).sum())

    # -- the record ------------------------------------------------------------------------------
    def _keep(self, step: int, reason: str, **figures) -> None:
        self.counts["kept"] += 1
        self._record(step, "kept", reason, **figures)
        return None

    def _record(self, step: int, action: str, reason: str, **figures) -> None:
        self.decisions.append({"step": step, "action": action, "reason": reason, **figures})

    @property
    def last_decision(self) -> dict | None:
        return self.decisions[-1] if self.decisions else None

    def snapshot(self) -> dict[str, Any]:
        """Plain values for the metrics files (:mod:`eplb_graph.control.gate_snapshot`)."""
        return gate_snapshot(self)
