"""``rearrange="when_it_pays"``: a plan is applied only if it repays its cost, and undone if it
made steps slower.

EPLB exists to make the busiest rank's step shorter. A rearrangement costs serving time (weights
staged, exchanged and installed while steps run, or inside one step when synchronous) and pays
back only in the steps after it. So, at every window close (identically on every rank: all the
inputs are sums from the window reduction):

1. **judge the last plan first.** Once the placement it installed has served enough decode steps,
   its mean step time is compared with the mean under the placement before it (at a comparable
   batch). Slower by more than :data:`SLOWER_TOLERANCE` and by more than the two means' noise
   (:data:`VERDICT_Z` standard errors): the old placement is planned back (a
   rollback), that plan is never applied again, and every later plan must repay twice as much
   (up to :data:`MAX_MARGIN`). No new plan is made while the last one is still being judged;
2. **predict.** Fit the expert cost model from the serving samples
   (:class:`~eplb_graph.control.cost_model.ExpertCostModel`), and predict the busiest rank's
   expert time per step of the committed placement and of three candidates, under the window's
   average load per step with its noise shrunk away
   (:func:`~eplb_graph.control.load_noise.shrink_to_signal`: the skew the window's time buckets
   show to be real): the configured policy's plan, the placement packed by predicted time
   (:func:`~eplb_graph.policy.predicted_time.pack_by_predicted_time`), and the few priced moves
   from the committed placement that repay the most
   (:func:`~eplb_graph.policy.incremental.improve_by_moves`: a fresh packing moves many slots,
   and often only a handful of them make the saving);
3. **repay.** A candidate may be applied only if its predicted saving over the next interval
   exceeds the cost of the experts it moves across ranks: the measured cost per moved copy of
   the rearrangements so far (what their in-flight steps took beyond the idle mean), or, before
   any was measured, a pessimistic prior from the copy's bytes (:data:`PRIOR_BYTES_PER_US`).
   Of those that may, the one with the largest net gain (saving over the interval less the
   cost) is applied: the fastest placement is not the best plan when it moves three times the
   copies for the last few percent.

Before step 2 builds any candidate, the committed placement's predicted time is set against a
floor no placement can beat (:func:`~eplb_graph.control.cost_model.lower_bound_step_us`): when
even that saving cannot repay one copy, the window is kept without planning. That is the common
case of a balanced or weight-read-bound engine, and the planning it skips (the policy's plan and
the packer, tens of ms) runs on the cores that serve. The floor counts the reads of the copies
that a layer with more slots than experts holds whatever its placement. And a window whose
candidates were all priced and refused answers for the next ones while the placement, margin
and copy cost stay and the floor's bound has not grown past :data:`REPRICE_GROWTH` times its own
(at most :data:`MAX_UNPRICED` in a row): at a small batch the bound can stay just above one copy's
cost while no candidate comes near it, and every window would pay to learn that again.

Every decision is kept (newest :data:`KEPT`) with its figures, for the metrics files, and so is
every window's check of the model: the busiest rank's predicted expert ms per step under the
committed placement against what the ranks measured over the same steps (``accuracy``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from eplb_graph.control.cost_model import (
    ExpertCostModel,
    lower_bound_step_us,
    predict_rank_us,
)
from eplb_graph.control.feedback import comparable_batches
from eplb_graph.control.load_noise import shrink_to_signal
from eplb_graph.control.window import WindowLoad
from eplb_graph.policy.incremental import improve_by_moves
from eplb_graph.policy.predicted_time import pack_by_predicted_time
from eplb_graph.policy.preserve import preserve_slots, relabel_ranks, transfers_needed

__all__ = ["PaybackGate"]

SLOWER_TOLERANCE = 0.03
"""A placement whose mean decode step is more than 3% slower than the one before it is undone
(less than that is within what two identical placements differ by on a busy host) ..."""
VERDICT_Z = 2.0
"""... and only when it is slower by more than this many standard errors of the difference of
the two means: at a small batch on a shared core, two epochs of the same placement differ by
more than 3% often enough that a good plan was undone (and every later one had to repay twice)."""
MIN_JUDGED_STEPS = 8
"""Decode steps needed on each side before a plan is judged."""
PRIOR_BYTES_PER_US = 100.0
"""Before any rearrangement was measured, moving one expert copy is taken to cost serving 1 µs
per 100 bytes of it (10 ms per MiB): it is staged, sent, received and installed on the cores
that serve, while steps run. Deliberately pessimistic (a first rearrangement is a gamble the
measured cost then corrects); a plan that pays anyway pays by a wide margin."""
PRIOR_COPY_READS = 100.0
"""The same prior where the bytes of a copy are unknown: 100 of its weight reads by the kernel."""
MAX_MARGIN = 8.0
KEPT = 16
REPRICE_GROWTH = 1.25
"""A window whose saving bound is more than this many times the bound of the last window whose
candidates were all priced and refused is priced again (its load moved toward a skew a plan
could use) ..."""
MAX_UNPRICED = 7
"""... and so is every window after this many kept in a row on the last pricing's word."""

PolicyPlan = torch.Tensor | Callable[[], torch.Tensor | None] | None
"""The configured policy's candidate: a plan, a callable making it on demand, or none."""


@dataclass
class _Pending:
    plan: torch.Tensor
    before: torch.Tensor
    epoch: int
    rollback: bool


@dataclass
class _Refusal:
    """The last window whose candidates were all priced and none repaid, and what it was priced
    under: while nothing of that changes, a window like it is refused again without pricing."""

    step: int
    committed: torch.Tensor
    margin: float
    copy_us: float
    bound_us: float
    unpriced: int = 0


@dataclass
class PaybackGate:
    """The decision maker of ``rearrange="when_it_pays"`` (see the module docstring).

    Args:
        num_ranks, num_slots: the cluster shape.
        max_replicas: lookup width ``R`` (no candidate gives an expert more copies).
        step_interval: steps between window closes: the horizon a plan must repay within.
        min_gain_percent: additionally, the predicted busiest-rank time must fall by this share.
        copy_bytes: bytes of one expert copy (the prior cost of a move; 0: unknown).
    """

    num_ranks: int
    num_slots: int
    max_replicas: int
    step_interval: int
    min_gain_percent: int = 0
    copy_bytes: int = 0
    model: ExpertCostModel | None = None
    margin: float = 1.0
    decisions: deque = field(default_factory=lambda: deque(maxlen=KEPT))
    counts: dict = field(
        default_factory=lambda: {"applied": 0, "kept": 0, "rollbacks": 0, "judged_kept": 0}
    )
    copy_us: float | None = None
    predicted_rank_ms: list | None = None
    measured_rank_ms: list | None = None
    accuracy: deque = field(default_factory=lambda: deque(maxlen=KEPT))
    published: dict | None = None
    _pending: _Pending | None = None
    _copies_applied: int = 0
    _initial: torch.Tensor | None = None
    _refused: deque = field(default_factory=lambda: deque(maxlen=KEPT))
    _last_refusal: _Refusal | None = None

    def decide(self, load: WindowLoad, policy_plan: PolicyPlan) -> torch.Tensor | None:
        """The placement to move to, or ``None`` to keep the committed one.

        ``policy_plan``: the configured policy's plan, or a callable that makes it (called only
        if some placement could repay a move), or ``None``.
        """
        try:
            return self._decide(load, policy_plan)
        finally:
            # One immutable document per decision: the metrics writer's thread reads it while
            # the next window may already be deciding on the worker's.
            self.published = self.snapshot()

    def _decide(self, load: WindowLoad, policy_plan: PolicyPlan) -> torch.Tensor | None:
        feedback = load.feedback
        if feedback is None:
            return self._keep(load, "no serving feedback in this window")
        self.model = ExpertCostModel.fit(feedback.moments) or self.model
        self._update_copy_cost(feedback)
        steps = feedback.steps_per_rank
        per_step = load.logical.sum(dim=0).to(torch.float64) / steps if steps else None
        if self.model is not None and per_step is not None:
            ranks = predict_rank_us(load.committed, per_step, self.num_ranks, self.model)
            self.predicted_rank_ms = (ranks.sum(axis=0) / 1e3).tolist()
            if self._initial is None:
                self._initial = load.committed
            initial = predict_rank_us(self._initial, per_step, self.num_ranks, self.model)
            self._check_prediction(
                load.step, feedback.measured_rank_us(), float(initial.sum(axis=0).max()) / 1e3
            )
        if self._pending is not None:
            verdict = self._judge(load)
            if verdict is not None:
                return verdict
            if self._pending is not None:
                return self._keep(load, "the last plan is still being judged")
        if self.model is None:
            return self._keep(load, "cost model not fitted yet (too few timed expert calls)")
        if per_step is None:
            return self._keep(load, "no load recorded in this window")
        # Plans are made and priced on the window's skew that is not noise: a plan fitted to a
        # window's noise is "predicted" to save and saves nothing (load_noise's docstring).
        per_step, signal = shrink_to_signal(load.logical, steps)
        signal_share = float(signal.mean())
        now = self._step_us(load.committed, per_step)
        floor = lower_bound_step_us(
            per_step, self.num_ranks, self.model, self.num_slots, self.max_replicas
        )
        figures = {
            "signal_share": signal_share,
            "predicted_step_ms_now": now / 1e3,
            "saving_bound_ms_per_step": max(0.0, now - floor) / 1e3,
            "horizon_steps": self.step_interval,
            "cost_ms": self._copy_cost_us() / 1e3,
            "margin": self.margin,
        }
        if self._cannot_repay(now, now - floor, copies=1):
            return self._keep(load, "no placement can repay a move", **figures)
        if self._refused_before(load.committed, now - floor):
            refusal = self._last_refusal
            refusal.unpriced += 1
            return self._keep(
                load, "nothing repaid when last priced, and the saving bound has not grown",
                priced_at_step=refusal.step, **figures,
            )  # fmt: skip
        if callable(policy_plan):
            policy_plan = policy_plan()
        plan = self._choose(load, per_step, policy_plan, now, signal_share)
        self._last_refusal = (
            None
            if plan is not None
            else _Refusal(load.step, load.committed, self.margin, self._copy_cost_us(), now - floor)
        )
        return plan

    def _refused_before(self, committed: torch.Tensor, bound_us: float) -> bool:
        """Whether the last priced refusal still answers this window: same placement, margin
        and copy cost, a saving bound not grown past :data:`REPRICE_GROWTH` times its own, and
        fewer than :data:`MAX_UNPRICED` windows kept on its word. Pricing (the policy's plan,
        the packer, the priced moves) is most of a window's work, and it runs on the cores that
        serve; at a small uniform batch the bound stays just above one copy's cost window after
        window while no candidate comes near it, so every window paid for the same refusal."""
        refusal = self._last_refusal
        return (
            refusal is not None
            and refusal.unpriced < MAX_UNPRICED
            and refusal.margin == self.margin
            and refusal.copy_us <= self._copy_cost_us()
            and bound_us <= REPRICE_GROWTH * refusal.bound_us
            and torch.equal(refusal.committed, committed)
        )

    def _check_prediction(
        self, step: int, measured_us: list[float] | None, initial: float | None
    ) -> None:
        """Set the busiest rank's predicted expert time against what the window measured
        (``initial``: what the placement the engine started with is predicted to take)."""
        if measured_us is None or len(measured_us) != self.num_ranks:
            self.measured_rank_ms = None
            return
        self.measured_rank_ms = [us / 1e3 for us in measured_us]
        predicted, measured = max(self.predicted_rank_ms), max(self.measured_rank_ms)
        if measured > 0:
            self.accuracy.append(
                {
                    "step": step,
                    "predicted_busiest_ms": predicted,
                    "measured_busiest_ms": measured,
                    "error": (predicted - measured) / measured,
                    "predicted_busiest_ms_initial": initial,
                }
            )

    # -- the last plan's verdict -------------------------------------------------------------
    def _judge(self, load: WindowLoad) -> torch.Tensor | None:
        pending, feedback = self._pending, load.feedback
        if feedback.epoch_index > pending.epoch + 1 or (
            feedback.epoch_index == pending.epoch + 1
            and not torch.equal(load.committed, pending.plan)
        ):
            self._pending = None  # replaced or aborted on the way: nothing to judge
            return None
        if feedback.epoch_index == pending.epoch or pending.rollback:
            if pending.rollback and feedback.epoch_index > pending.epoch:
                self._pending = None  # a rollback is not judged again (no ping-pong)
            return None
        before, after = feedback.previous, feedback.current
        if min(before.steps, after.steps) < MIN_JUDGED_STEPS:
            return None
        self._pending = None
        tokens_before, tokens_after = before.mean_tokens, after.mean_tokens
        figures = {
            "step_ms_before": before.mean_step_us / 1e3,
            "step_ms_after": after.mean_step_us / 1e3,
            "tokens_before": tokens_before,
            "tokens_after": tokens_after,
        }
        if not comparable_batches(tokens_after, tokens_before):
            self._record(load, "judged", "no verdict: the batch changed", **figures)
            return None
        slower_us = after.mean_step_us - before.mean_step_us
        errors = [epoch.mean_error_us(feedback.ranks) or 0.0 for epoch in (before, after)]
        noise_us = VERDICT_Z * (errors[0] ** 2 + errors[1] ** 2) ** 0.5
        figures["noise_ms"] = noise_us / 1e3
        if slower_us > max(SLOWER_TOLERANCE * before.mean_step_us, noise_us):
            self.counts["rollbacks"] += 1
            self.margin = min(MAX_MARGIN, self.margin * 2)
            self._refused.append(pending.plan)
            self._pending = _Pending(pending.before, load.committed, feedback.epoch_index, True)
            self._copies_applied += int(
                transfers_needed(load.committed, pending.before, self.num_ranks).sum()
            )
            self._record(load, "rollback", "steps got slower under the last plan", **figures)
            return pending.before.clone()
        self.counts["judged_kept"] += 1
        self._record(load, "judged", "the last plan did not slow steps down", **figures)
        return None

    # -- a new plan ------------------------------------------------------------------------------
    def _cannot_repay(self, now: float, saving: float, copies: int) -> bool:
        """Whether ``saving`` µs per step falls short of ``min_gain_percent`` or of repaying
        ``copies`` moved copies within the horizon."""
        if self.min_gain_percent and saving < now * self.min_gain_percent / 100:
            return True
        return saving * self.step_interval <= self.margin * copies * self._copy_cost_us()

    def _choose(
        self,
        load: WindowLoad,
        per_step: torch.Tensor,
        policy_plan: torch.Tensor | None,
        now: float,
        signal: float,
    ) -> torch.Tensor | None:
        model, committed, copy_us = self.model, load.committed, self._copy_cost_us()
        packed = pack_by_predicted_time(
            per_step, self.num_slots, self.num_ranks, self.max_replicas, model
        )
        packed = preserve_slots(committed, relabel_ranks(committed, packed, self.num_ranks),
                                self.num_ranks)  # fmt: skip
        candidates = {
            "predicted_time": packed,
            "fewest_moves": improve_by_moves(
                committed, per_step, self.num_ranks, self.max_replicas, model,
                self.margin * copy_us, self.step_interval,
            ),
        }  # fmt: skip
        if policy_plan is not None:
            candidates["policy"] = policy_plan
        figures = {name: {"signal_share": signal,
                          **self._figures(committed, plan, per_step, now, copy_us)}
                   for name, plan in candidates.items()}  # fmt: skip
        reasons = {name: self._refusal(committed, plan, figures[name], now)
                   for name, plan in candidates.items()}  # fmt: skip
        eligible = [name for name in candidates if reasons[name] is None]
        if not eligible:
            # Report the faster candidate that came closest to repaying (the fastest when none
            # is faster than the committed placement).
            faster = [n for n in candidates if figures[n]["saving_ms_per_step"] > 0]
            name = (
                max(faster, key=lambda n: (figures[n]["net_ms"], n))
                if faster
                else min(candidates, key=lambda n: (figures[n]["predicted_step_ms_plan"], n))
            )
            return self._keep(load, reasons[name], candidate=name, **figures[name])
        name = max(eligible, key=lambda n: (figures[n]["net_ms"], n == "policy", n))
        plan, chosen = candidates[name], figures[name]
        self.counts["applied"] += 1
        self._copies_applied += chosen["copies"]
        self._pending = _Pending(plan, committed, load.feedback.epoch_index, False)
        self._record(load, "applied", "predicted to repay its move", candidate=name, **chosen)
        return plan

    def _figures(
        self,
        committed: torch.Tensor,
        plan: torch.Tensor,
        per_step: torch.Tensor,
        now: float,
        copy_us: float,
    ) -> dict[str, Any]:
        """A candidate's predicted step, saving, copies, cost and net gain over the horizon."""
        predicted = self._step_us(plan, per_step)
        copies = int(transfers_needed(committed, plan, self.num_ranks).sum())
        cost = self.margin * copies * copy_us
        return {
            "predicted_step_ms_now": now / 1e3,
            "predicted_step_ms_plan": predicted / 1e3,
            "saving_ms_per_step": (now - predicted) / 1e3,
            "horizon_steps": self.step_interval,
            "copies": copies,
            "cost_ms": copies * copy_us / 1e3,
            "margin": self.margin,
            "net_ms": ((now - predicted) * self.step_interval - cost) / 1e3,
        }

    def _refusal(
        self, committed: torch.Tensor, plan: torch.Tensor, figures: dict, now: float
    ) -> str | None:
        """Why a candidate must not be applied, or ``None`` if it may."""
        saving = figures["saving_ms_per_step"] * 1e3
        if torch.equal(plan, committed) or saving <= 0:
            return "no placement is predicted faster"
        if any(torch.equal(plan, refused) for refused in self._refused):
            return "this plan made steps slower before"
        if self.min_gain_percent and saving < now * self.min_gain_percent / 100:
            return "predicted gain below min_gain_percent"
        if figures["net_ms"] <= 0:
            return "the saving does not repay the move"
        return None

    def _step_us(self, phy2log: torch.Tensor, per_step: torch.Tensor) -> float:
        return float(predict_rank_us(phy2log, per_step, self.num_ranks, self.model).max(1).sum())

    def _update_copy_cost(self, feedback) -> None:
        moved = feedback.movement_cost_us
        if moved is not None and self._copies_applied:
            self.copy_us = moved / self._copies_applied

    def _copy_cost_us(self) -> float:
        if self.copy_us is not None:
            return self.copy_us
        if self.copy_bytes:
            return self.copy_bytes / PRIOR_BYTES_PER_US
        return PRIOR_COPY_READS * max(self.model.read_us, self.model.row_us, 1.0)

    # -- the record ------------------------------------------------------------------------------
    def _keep(self, load: WindowLoad, reason: str, **figures) -> None:
        self.counts["kept"] += 1
        self._record(load, "kept", reason, **figures)
        return None

    def _record(self, load: WindowLoad, action: str, reason: str, **figures) -> None:
        self.decisions.append({"step": load.step, "action": action, "reason": reason, **figures})

    def snapshot(self) -> dict[str, Any]:
        """Plain values for the metrics files (the model, the counts, recent decisions)."""
        return {
            "model": self.model.as_dict() if self.model is not None else None,
            "predicted_rank_ms": self.predicted_rank_ms,
            "measured_rank_ms": self.measured_rank_ms,
            "accuracy": list(self.accuracy),
            "copy_ms": None if self.copy_us is None else self.copy_us / 1e3,
            "margin": self.margin,
            **self.counts,
            "decisions": list(self.decisions),
        }
