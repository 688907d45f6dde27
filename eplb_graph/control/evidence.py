"""What one closed window tells the payback gate: the model, the load, what the ranks measured.

Identical on every rank: every input is a sum from the window reduction. When the traffic
changed within the window (its newer time buckets' expert shares far from its older ones'), the
load is the newer half's: a plan for the blend of two loads fits neither. The load comes twice:
as served (what the ranks measured was measured under it, so judging what ran uses it) and with
its noise shrunk away (:func:`~eplb_graph.control.load_noise.shrink_to_signal`: planning on a
window's noise predicts savings that never come).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from eplb_graph.control.calibration import SIMILAR_LOAD, load_distance, load_shares
from eplb_graph.control.cost_model import ExpertCostModel, predict_rank_us
from eplb_graph.control.load_noise import shrink_to_signal
from eplb_graph.control.window import WindowLoad

__all__ = ["Evidence", "PredictionCheck", "check_prediction", "read_window"]


@dataclass
class Evidence:
    """What one window tells the gate."""

    step: int
    committed: torch.Tensor
    model: ExpertCostModel
    served: torch.Tensor
    """``[L, N]`` rows per step as served (judging what ran)."""
    planned: torch.Tensor
    """``[L, N]`` the same with the noise shrunk away (planning)."""
    signal_share: float
    measured_step_us: float | None
    """The ranks' expert µs per step, each layer's busiest rank summed (what a step waits for),
    over the window; ``None`` where it was not measured under one placement."""
    measured_rank_us: list[float] | None
    """Each rank's expert µs per step over all layers (``None`` likewise)."""
    movement_cost_us: float | None
    """What moving weights has cost serving so far (the ranks' running total, µs)."""
    shifted: bool = False
    """The traffic changed within the window: the load is its newer half's."""
    copy_us: float = 0.0
    """The price of one copy, learnt from the moves measured so far (set by the gate)."""
    floor_us: float | None = None
    """The least any placement is predicted to take under ``planned`` (the gate's, once)."""
    against_calibration: float | None = None
    """What the ranks measured over what the committed placement's calibration under a load
    like this one expected (set by the gate; ``None`` where it had none)."""
    disturbed: bool = False
    """Too far from it: the window calibrated nothing and credited no move (set by the gate)."""

    def figures(self) -> dict[str, Any]:
        """What every decision on this window records of it."""
        return {
            "shifted": self.shifted,
            "signal_share": self.signal_share,
            "measured_vs_calibrated": self.against_calibration,
            "disturbed": self.disturbed,
        }


def read_window(
    load: WindowLoad, model: ExpertCostModel | None, num_ranks: int
) -> tuple[ExpertCostModel | None, Evidence | str]:
    """``(model, evidence)``: the model refitted from the window's cost samples (``model`` kept
    when they fit none), and the window's evidence, or the reason it gives none to decide on.

    Whatever serving reported is checked here, so a window of zeros, negative or huge values
    is a reason to keep the placement, never an error further on.
    """
    feedback = load.feedback
    if feedback is None:
        return model, "no serving feedback in this window"
    fitted = ExpertCostModel.fit(feedback.moments)
    if fitted is not None and _finite(fitted):
        model = fitted
    logical = load.logical.to(torch.float64)
    if not bool(torch.isfinite(logical).all()) or bool((logical < 0).any()):
        return model, "the window's load is not a count"
    if model is None:
        return model, "cost model not fitted yet (too few timed expert calls)"
    steps = feedback.steps_per_rank
    if steps <= 0 or float(logical.sum()) <= 0:
        return model, "no load recorded in this window"
    newer = _after_a_shift(logical)
    if newer is not None:
        # The traffic changed within the window: plan on what it serves now. What the ranks
        # measured blends two loads, so it neither calibrates nor judges a placement.
        steps *= newer.shape[0] / logical.shape[0]
        logical = newer
    served = logical.sum(dim=0) / steps
    planned, signal = shrink_to_signal(logical, steps)
    measured_ranks = None if newer is not None else feedback.measured_rank_us()
    if measured_ranks is not None and (
        len(measured_ranks) != num_ranks
        or not all(math.isfinite(us) and us > 0 for us in measured_ranks)
    ):
        measured_ranks = None
    return model, Evidence(
        step=load.step,
        committed=load.committed,
        model=model,
        served=served,
        planned=planned,
        signal_share=float(signal.mean()),
        measured_step_us=None
        if newer is not None
        else _measured_step_us(feedback, load.committed.shape[0], num_ranks),
        measured_rank_us=measured_ranks,
        movement_cost_us=feedback.movement_cost_us,
        shifted=newer is not None,
    )


def _after_a_shift(logical: torch.Tensor) -> torch.Tensor | None:
    """The newer half of the window's time buckets when the load's expert shares in it are
    more than :data:`~eplb_graph.control.calibration.SIMILAR_LOAD` away from the older half's,
    and further than sampling alone would put them (the traffic shifted within the window),
    else ``None``."""
    count = logical.shape[0]
    if count < 4:
        return None
    older, newer = logical[: count // 2].sum(dim=0), logical[count // 2 :].sum(dim=0)
    if float(older.sum()) <= 0 or float(newer.sum()) <= 0:
        return None
    distance = load_distance(load_shares(older), load_shares(newer))
    if distance <= max(SIMILAR_LOAD, SHIFT_NOISE_MARGIN * _sampling_distance(older, newer)):
        return None
    return logical[count // 2 :]


SHIFT_NOISE_MARGIN = 2.0
"""A shift is a distance at least twice what sampling the same traffic twice gives: a window of a
few small steps (a handful of rows per expert) differs that much between its halves by chance,
and reading it as a shift left every such window unmeasured."""


def _sampling_distance(older: torch.Tensor, newer: torch.Tensor) -> float:
    """The expected total-variation distance between the two halves' shares (``[L, N]`` rows
    each) if both drew their rows from the same shares (their pooled ones), averaged over
    layers: each share's difference is about normal, ``E|d| = sqrt(2 / pi) * sigma``."""
    older, newer = older.to(torch.float64), newer.to(torch.float64)
    rows_older = older.sum(dim=1, keepdim=True).clamp(min=1.0)
    rows_newer = newer.sum(dim=1, keepdim=True).clamp(min=1.0)
    pooled = load_shares(older + newer)
    variance = pooled * (1.0 - pooled) * (1.0 / rows_older + 1.0 / rows_newer)
    expected = 0.5 * math.sqrt(2.0 / math.pi) * variance.sqrt().sum(dim=1)
    return float(expected.mean())


@dataclass(frozen=True)
class PredictionCheck:
    predicted_ms: list[float]
    """Each rank's predicted expert ms per step under the committed placement."""
    measured_ms: list[float] | None
    entry: dict | None
    """The busiest rank's predicted against measured ms (``None`` when nothing was measured)."""


def check_prediction(evidence: Evidence, initial: torch.Tensor, num_ranks: int) -> PredictionCheck:
    """Set the busiest rank's predicted expert time against what the window measured, and say
    what the starting placement is predicted to take under the same load."""
    model, served = evidence.model, evidence.served
    ranks = predict_rank_us(evidence.committed, served, num_ranks, model).sum(axis=0)
    predicted_ms = (ranks / 1e3).tolist()
    measured = evidence.measured_rank_us
    if measured is None:
        return PredictionCheck(predicted_ms, None, None)
    measured_ms = [us / 1e3 for us in measured]
    predicted, busiest = max(predicted_ms), max(measured_ms)
    start = predict_rank_us(initial, served, num_ranks, model).sum(axis=0).max() / 1e3
    entry = {
        "step": evidence.step,
        "predicted_busiest_ms": predicted,
        "measured_busiest_ms": busiest,
        "error": (predicted - busiest) / busiest,
        "predicted_busiest_ms_initial": float(start),
    }
    return PredictionCheck(predicted_ms, measured_ms, entry)


def _measured_step_us(feedback, num_layers: int, num_ranks: int) -> float | None:
    layers = feedback.measured_layer_us()
    if layers is None or len(layers) != num_layers:
        return None
    if any(len(layer) != num_ranks for layer in layers):
        return None
    step = sum(max(layer) for layer in layers)
    return step if math.isfinite(step) and step > 0 else None


def _finite(model: ExpertCostModel) -> bool:
    return all(
        math.isfinite(value) and value >= 0
        for value in (model.fixed_us, model.row_us, model.read_us)
    )
