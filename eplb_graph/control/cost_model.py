"""A rank's expert time as a function of its rows *and* its active experts, fitted on the engine.

Why not rows alone: an expert kernel reads every *active* expert's weights once per call and then
pays per row. At the batch sizes people decode at, the reads are most of a rank's expert time
(vLLM's CPU kernel: about 7 ms for 32 experts of a 1024 x 512 layer, then about 0.02 ms per
row), so evening the rows saves little, and a replica can cost more than it saves: it adds a
weight read on the rank that holds it whenever any of the expert's rows land there. A policy
that predicts time from counts cannot see either effect.

The model, per MoE layer and rank, for one call of the rank's expert op::

    time_us = fixed_us + row_us * rows + read_us * active_slots

``active_slots`` is the number of the rank's slots that computed at least one row. It is fitted
by least squares with non-negative coefficients from samples of that very op: every call adds
``(rows, active_slots, us)`` (``EplbState.expert_stats`` keeps running sums per layer; the
controller takes per-step deltas) and a short calibration at attach adds points the serving
load does not reach yet. The samples are kept as integer moments (sums of products, in µs and
counts), so every rank's moments add up in the window reduction the pipeline already does, and
every rank fits the same model from the same sums: the plans stay identical everywhere.

:func:`predict_rank_us` turns a placement and a window's average per-step load into each rank's
predicted time per layer, taking the expected number of active slots from the routing rule (an
expert's rows spread uniformly over its replicas, so a slot with ``m`` expected rows per step is
active with probability ``1 - exp(-m)``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "MOMENTS",
    "CostMoments",
    "ExpertCostModel",
    "layer_floors_us",
    "lower_bound_step_us",
    "predict_rank_us",
    "predicted_step_us",
]

MOMENTS = 10
"""Length of a moments vector: n, Σr, Σa, Σt, Σrr, Σra, Σaa, Σrt, Σat, Σtt (r rows, a active
slots, t µs of one call)."""

MIN_SAMPLES = 32
"""Fewer calls than this fit nothing: a model from a handful of calls would decide moves."""

AGE_FROM = 4 * MIN_SAMPLES
"""The history ages only while it holds at least this many calls. Ageing a short history at
every window close kept it below :data:`MIN_SAMPLES` for good where few calls are timed per
window (a small eager engine, short windows, most steps moving weights): the model never fitted
and the gate never decided anything."""


class CostMoments:
    """Running integer sums of one op's calls, ready to be summed across ranks.

    ``add`` takes arrays of calls and ``add_call`` one call (the serving thread's per-step path:
    Python integers, no tensor work); ``age_`` ages the history at a window close, so the fit
    follows a machine whose speed changes while every rank still sums the same kind of number.
    """

    def __init__(self) -> None:
        self._sums = [0] * MOMENTS

    @property
    def values(self) -> torch.Tensor:
        """The sums as an int64 tensor (a copy: what a window's reduction carries)."""
        return torch.tensor(self._sums, dtype=torch.int64)

    @values.setter
    def values(self, values: torch.Tensor) -> None:
        sums = [int(v) for v in torch.as_tensor(values).tolist()]
        if len(sums) != MOMENTS:
            raise ValueError(f"a moments vector has {MOMENTS} values, got {len(sums)}")
        self._sums = sums

    def add(self, rows, active, micros) -> None:
        """Add calls: ``rows``, ``active`` (slots with rows) and ``micros`` (µs), equal lengths."""
        r = np.asarray(rows, dtype=np.int64)
        a = np.asarray(active, dtype=np.int64)
        t = np.asarray(micros, dtype=np.int64)
        if not (r.shape == a.shape == t.shape) or r.ndim != 1:
            raise ValueError(f"rows, active, micros must be 1-D of one length: {r.shape}")
        if (r < 0).any() or (a < 0).any() or (t < 0).any():
            raise ValueError("rows, active slots and times cannot be negative")
        for call in zip(r.tolist(), a.tolist(), t.tolist(), strict=True):
            self.add_call(*call)

    def add_call(self, r: int, a: int, t: int) -> None:
        """Add one call (non-negative ints: rows, active slots, µs)."""
        sums = self._sums
        sums[0] += 1
        sums[1] += r
        sums[2] += a
        sums[3] += t
        sums[4] += r * r
        sums[5] += r * a
        sums[6] += a * a
        sums[7] += r * t
        sums[8] += a * t
        sums[9] += t * t

    @property
    def count(self) -> int:
        """Calls in the history (weighted by their age)."""
        return self._sums[0]

    def age_(self) -> None:
        """Age the history: every sum halves (older calls weigh half as much after each close),
        once it holds :data:`AGE_FROM` calls; a shorter one keeps growing until it can fit."""
        if self._sums[0] >= AGE_FROM:
            self._sums = [v // 2 for v in self._sums]


@dataclass(frozen=True)
class ExpertCostModel:
    """``time_us = fixed_us + row_us * rows + read_us * active_slots`` for one call of one rank.

    Attributes:
        fixed_us, row_us, read_us: non-negative coefficients.
        samples: calls the fit saw (after ageing).
        fit_error: root-mean-square residual over the mean call time (0.1 = 10%).
    """

    fixed_us: float
    row_us: float
    read_us: float
    samples: int
    fit_error: float

    @classmethod
    def fit(cls, moments: torch.Tensor) -> ExpertCostModel | None:
        """Least squares with non-negative coefficients from a moments vector (``None``: too few
        calls, or no time at all).

        Every subset of the three terms is solved (7 small systems) and the feasible solution
        with the smallest residual wins: exact non-negative least squares for three unknowns,
        deterministic, so every rank fitting the same sums gets the same model.
        """
        m = [float(v) for v in torch.as_tensor(moments).tolist()]
        n, sr, sa, st, srr, sra, saa, srt, sat, stt = m
        if n < MIN_SAMPLES or st <= 0:
            return None
        gram = np.array([[n, sr, sa], [sr, srr, sra], [sa, sra, saa]])
        rhs = np.array([st, srt, sat])
        best: tuple[float, np.ndarray] | None = None
        for size in (1, 2, 3):
            for terms in itertools.combinations(range(3), size):
                index = list(terms)
                sub = gram[np.ix_(index, index)]
                if np.linalg.cond(sub) > 1e12:
                    continue  # the terms cannot be told apart from these calls
                solution = np.linalg.solve(sub, rhs[index])
                if (solution < 0).any():
                    continue
                beta = np.zeros(3)
                beta[index] = solution
                residual = stt - 2 * float(beta @ rhs) + float(beta @ gram @ beta)
                if best is None or residual < best[0]:
                    best = (max(0.0, residual), beta)
        if best is None:
            return None
        residual, beta = best
        mean = st / n
        return cls(
            fixed_us=float(beta[0]),
            row_us=float(beta[1]),
            read_us=float(beta[2]),
            samples=int(n),
            fit_error=math.sqrt(residual / n) / mean,
        )

    def call_us(self, rows: float, active: float) -> float:
        """Predicted µs of one call with ``rows`` rows over ``active`` active slots."""
        return self.fixed_us + self.row_us * rows + self.read_us * active

    def as_dict(self) -> dict:
        return {
            "fixed_us": self.fixed_us,
            "row_us": self.row_us,
            "read_us": self.read_us,
            "samples": self.samples,
            "fit_error": self.fit_error,
        }


def predict_rank_us(
    phy2log: torch.Tensor, per_step: torch.Tensor, num_ranks: int, model: ExpertCostModel
) -> np.ndarray:
    """``[L, ranks]`` predicted µs per step of every rank's expert op under ``phy2log [L, P]``.

    Args:
        phy2log: ``[L, P]`` placement.
        per_step: ``[L, N]`` average rows per step of every logical expert (a window's load
            divided by its steps).
        num_ranks: EP ranks (rank ``r`` holds slots ``[r P / ranks, (r + 1) P / ranks)``).
        model: the fitted cost model.
    """
    table = torch.as_tensor(phy2log).to(torch.int64).numpy()
    load = torch.as_tensor(per_step).to(torch.float64).numpy()
    num_layers, num_slots = table.shape
    copies = np.zeros_like(load)
    np.add.at(copies, (np.repeat(np.arange(num_layers), num_slots), table.reshape(-1)), 1.0)
    slot_rows = np.take_along_axis(load / np.maximum(copies, 1.0), table, axis=1)  # [L, P]
    active = 1.0 - np.exp(-slot_rows)
    rows_per_rank = slot_rows.reshape(num_layers, num_ranks, -1).sum(axis=2)
    active_per_rank = active.reshape(num_layers, num_ranks, -1).sum(axis=2)
    return model.fixed_us + model.row_us * rows_per_rank + model.read_us * active_per_rank


def predicted_step_us(
    phy2log: torch.Tensor, per_step: torch.Tensor, num_ranks: int, model: ExpertCostModel
) -> float:
    """Predicted busiest-rank expert µs of one step, summed over layers (each layer's combine
    waits for its busiest rank)."""
    return float(predict_rank_us(phy2log, per_step, num_ranks, model).max(axis=1).sum())


def lower_bound_step_us(
    per_step: torch.Tensor,
    num_ranks: int,
    model: ExpertCostModel,
    num_slots: int | None = None,
    max_replicas: int | None = None,
) -> float:
    """A floor under :func:`predicted_step_us` of *every* placement of ``per_step`` (``[L, N]``)
    into ``num_slots`` slots with at most ``max_replicas`` copies of an expert.

    Per layer, the busiest rank takes at least the ranks' mean: every rank pays ``fixed_us``,
    and the rows are the rows wherever they go. The reads are where placements differ: an
    expert with ``x`` expected rows split over ``c`` copies is active on
    ``f(c) = c (1 - exp(-x / c))`` slots, which never falls as ``c`` grows (its derivative is
    ``1 - exp(-u) (1 + u) >= 0``, ``u = x / c``) and is concave in ``c``. So one copy per expert
    reads the least, but a layer has ``P - N`` slots more than experts and every slot holds a
    copy: those extra copies are paid for whatever the placement. Concavity puts ``f`` above its
    chord between 1 and ``R`` copies, so each extra copy of an expert adds at least the chord's
    slope, and the cheapest ``P - N`` of those slopes (``R - 1`` per expert) are a floor under
    the extra reads. Without it, the floor sat one forced copy's reads per replica below every
    real placement: at a small uniform batch (a replica's read about 1 ms of the step) the gate
    concluded a plan might repay and built and priced candidates each window for nothing.

    What the committed placement is predicted to take above this floor bounds what any plan can
    save, so a planner can tell that no plan repays a move without building one.
    ``num_slots`` ``None``: one slot per expert (no forced copies).
    """
    return float(layer_floors_us(per_step, num_ranks, model, num_slots, max_replicas).sum())


def layer_floors_us(
    per_step: torch.Tensor | np.ndarray,
    num_ranks: int,
    model: ExpertCostModel,
    num_slots: int | None = None,
    max_replicas: int | None = None,
) -> np.ndarray:
    """``[L]``: :func:`lower_bound_step_us` layer by layer (a search that moves one layer's
    slots stops where that layer is within a copy's cost of its own floor)."""
    load = torch.as_tensor(per_step).to(torch.float64).numpy()
    num_experts = load.shape[1]
    rows = load.sum(axis=1)
    active = (1.0 - np.exp(-load)).sum(axis=1)
    extra = 0 if num_slots is None else num_slots - num_experts
    if extra < 0:
        raise ValueError(f"{num_slots} slots cannot hold {num_experts} experts")
    cap = min(max_replicas or 1 + extra, 1 + extra)
    if extra and cap > 1:
        # Slope of each expert's chord from 1 to ``cap`` copies; an expert takes at most
        # ``cap - 1`` extra copies, so the cheapest ``extra`` slopes, each repeated that often.
        one = 1.0 - np.exp(-load)
        capped = cap * (1.0 - np.exp(-load / cap))
        slopes = np.sort((capped - one) / (cap - 1), axis=1)
        slopes = np.repeat(slopes, cap - 1, axis=1)[:, :extra]
        active = active + slopes.sum(axis=1)
    return model.fixed_us + (model.row_us * rows + model.read_us * active) / num_ranks
