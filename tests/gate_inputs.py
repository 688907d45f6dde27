"""Windows for the payback gate, built the way an engine's ranks would report them.

:class:`Serving` feeds a gate one window at a time: the load served per step, the cost samples
of a known kernel (so the gate fits that kernel), and what the ranks measured, which is what the
fitted model predicts for the committed placement times a factor the test chooses (``slower``:
a placement the model misjudges). It follows the gate's decisions the way the pipeline would:
a returned plan is the committed placement of the next window.
"""

from __future__ import annotations

import numpy as np
import torch

from eplb_graph.control.cost_model import CostMoments, ExpertCostModel, predict_rank_us
from eplb_graph.control.feedback import WindowFeedback
from eplb_graph.control.window import WindowLoad

RANKS = 2
READS = ExpertCostModel(fixed_us=50.0, row_us=2.0, read_us=200.0, samples=100, fit_error=0.0)
ROWS = ExpertCostModel(fixed_us=50.0, row_us=20.0, read_us=1.0, samples=100, fit_error=0.0)


def kernel_calls(model: ExpertCostModel, count: int, seed: int = 0):
    """``(rows, active, micros)`` of ``count`` calls of a kernel that follows ``model``."""
    generator = np.random.default_rng(seed)
    active = generator.integers(1, 33, count)
    rows = active * generator.integers(1, 40, count)
    micros = np.round(model.fixed_us + model.row_us * rows + model.read_us * active)
    return rows, active, micros


def moments_of(model: ExpertCostModel, count: int = 100) -> torch.Tensor:
    moments = CostMoments()
    moments.add(*kernel_calls(model, count))
    return moments.values


def skewed(num_layers: int = 2, scale: float = 1.0, hot_first: bool = True) -> torch.Tensor:
    """``[L, 32]`` rows per step, Zipf 1.2 over the experts: experts 0, 1, 2, ... hottest
    (all on rank 0 under the default layout), or 31, 30, ... (on rank 1) with ``hot_first``
    off."""
    ranks = torch.arange(32, dtype=torch.float64)
    load = (scale * (ranks + 1) ** -1.2).repeat(num_layers, 1)
    return load if hot_first else load.flip(1)


class Serving:
    """Windows of ``steps`` decode steps each on ``RANKS`` ranks with a ``model`` kernel.

    Args:
        model: the kernel the cost samples follow (the gate fits it back).
        steps: steps per window (the load is ``per_step * steps``).
        interval: steps between window closes (the window's ``step``).
    """

    def __init__(self, model: ExpertCostModel = READS, steps: int = 10, interval: int = 100):
        self.moments = moments_of(model)
        self.fitted = ExpertCostModel.fit(self.moments)
        self.steps = steps
        self.interval = interval
        self.step = 0
        self.cost_us = 0
        self.moving_steps = 0

    def measured_us(self, committed: torch.Tensor, per_step: torch.Tensor, slower: float):
        """Each layer's and rank's expert µs over the window (layer-major): the fitted model's
        prediction x ``slower``."""
        cells = predict_rank_us(committed, per_step, RANKS, self.fitted).reshape(-1)
        return [int(us * slower * self.steps) for us in cells]

    def window(
        self,
        committed: torch.Tensor,
        per_step: torch.Tensor,
        *,
        slower: float = 1.0,
        moved_us: int = 0,
        moved_steps: int = 0,
        measured: bool = True,
        before: torch.Tensor | None = None,
    ) -> WindowLoad:
        """The next window under ``committed``; ``moved_us`` / ``moved_steps``: what moving
        cost serving since the last window (added to the ranks' running totals); ``before``:
        the load of the window's older half (the traffic shifted within it to ``per_step``)."""
        self.step += self.interval
        self.cost_us += moved_us
        self.moving_steps += moved_steps
        expert_us = self.measured_us(committed, per_step, slower)
        expert_us = expert_us if measured else [0] * len(expert_us)
        head = [RANKS, self.steps, 1]
        epochs = [0, 0, 0, 0, 40, 40 * 10_000, 40 * 8, 40 * 1000**2]
        tail = [0, RANKS * self.cost_us, RANKS * self.moving_steps, RANKS * self.moving_steps]
        window = [RANKS * self.steps * measured, 0, *expert_us]
        vector = torch.tensor(
            head + self.moments.tolist() + epochs + tail + window, dtype=torch.int64
        )
        return WindowLoad(
            step=self.step,
            logical=self._buckets(per_step, before),
            physical=torch.zeros(committed.shape, dtype=torch.int64),
            committed=committed,
            feedback=WindowFeedback.parse(vector),
        )

    def _buckets(self, per_step: torch.Tensor, before: torch.Tensor | None) -> torch.Tensor:
        """``[B, L, N]``: one bucket of the window's load, or four when it shifted midway."""
        if before is None:
            return (per_step * self.steps).round().to(torch.int64).unsqueeze(0)
        quarter = self.steps / 4
        halves = [before, before, per_step, per_step]
        return torch.stack([(load * quarter).round() for load in halves]).to(torch.int64)
