"""A window's skew, told apart from its noise by its own time buckets (control/load_noise.py),
and the gate that plans on what is left: a uniform router's noise is never a reason to move."""

from __future__ import annotations

import pytest
import torch

from eplb_graph.control import payback
from eplb_graph.control.cost_model import ExpertCostModel
from eplb_graph.control.feedback import WindowFeedback
from eplb_graph.control.load_noise import shrink_to_signal
from eplb_graph.control.payback import PaybackGate
from eplb_graph.control.window import WindowLoad
from eplb_graph.placement import Placement
from tests.test_control_cost_model import _feedback

LAYERS, EXPERTS, BUCKETS, RANKS = 2, 32, 8, 2
ROWS = ExpertCostModel(fixed_us=50.0, row_us=20.0, read_us=1.0, samples=100, fit_error=0.0)


def _buckets(weights: torch.Tensor, rows_per_bucket: int, seed: int) -> torch.Tensor:
    """``[T, L, N]`` counts: each bucket's rows routed by ``weights`` (multinomial)."""
    generator = torch.Generator().manual_seed(seed)
    buckets = torch.zeros(BUCKETS, LAYERS, EXPERTS, dtype=torch.int64)
    for bucket in range(BUCKETS):
        for layer in range(LAYERS):
            picks = torch.multinomial(weights, rows_per_bucket, True, generator=generator)
            buckets[bucket, layer] = torch.bincount(picks, minlength=EXPERTS)
    return buckets


UNIFORM = torch.ones(EXPERTS)
SKEWED = torch.where(torch.arange(EXPERTS) < 8, 8.0, 1.0)  # experts 0-7: all on rank 0


@pytest.mark.parametrize("seed", range(5))
def test_a_uniform_router_is_noise_and_a_skewed_one_is_signal(seed):
    uniform, signal_uniform = shrink_to_signal(_buckets(UNIFORM, 1024, seed), steps=32)
    skewed, signal_skewed = shrink_to_signal(_buckets(SKEWED, 1024, seed), steps=32)
    assert float(signal_uniform.max()) < 0.5
    assert float(signal_skewed.min()) > 0.95
    # The shrunk uniform load is within 1% of even; the skewed one keeps its skew.
    even = 8 * 1024 / 32 / EXPERTS
    assert torch.allclose(uniform, torch.full_like(uniform, even), rtol=0.01)
    assert float(skewed[:, :8].mean() / skewed[:, 8:].mean()) > 7.0
    # Rows are kept: shrinking moves load between experts, never adds or drops any.
    for shrunk, weights in ((uniform, UNIFORM), (skewed, SKEWED)):
        raw = _buckets(weights, 1024, seed).sum(dim=0) / 32
        assert torch.allclose(shrunk.sum(dim=1), raw.to(torch.float64).sum(dim=1))


def test_a_batch_that_grows_within_the_window_is_not_noise():
    counts = _buckets(SKEWED, 256, 0)
    grown = counts * torch.arange(1, BUCKETS + 1).view(-1, 1, 1)  # 1x .. 8x the rows
    _, signal = shrink_to_signal(grown, steps=32)
    assert float(signal.min()) > 0.9


def test_one_bucket_cannot_tell_noise_from_skew_and_is_left_as_is():
    counts = _buckets(UNIFORM, 1024, 0).sum(dim=0, keepdim=True)
    per_step, signal = shrink_to_signal(counts, steps=32)
    assert torch.equal(signal, torch.ones(LAYERS, dtype=torch.float64))
    assert torch.allclose(per_step, counts[0].to(torch.float64) / 32)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=r"\[T, L, N\]"):
        shrink_to_signal(torch.ones(3, 4), steps=1)
    with pytest.raises(ValueError, match="steps must be positive"):
        shrink_to_signal(torch.ones(2, 3, 4), steps=0)


def _window(logical: torch.Tensor, committed: torch.Tensor) -> WindowLoad:
    vector = _feedback(recorded=32)  # a fitted model's moments, 32 recorded steps
    return WindowLoad(
        100, logical, torch.zeros(committed.shape, dtype=torch.int64), committed,
        WindowFeedback.parse(vector),
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(3))
def test_the_gate_does_not_move_on_a_uniform_routers_noise(seed, monkeypatch):
    committed = Placement.default(LAYERS, EXPERTS, 8, RANKS).phy2log
    noisy = _buckets(UNIFORM, 128, seed)
    # Told as one bucket, the same counts look like a skew worth moving for (copies are cheap
    # over this horizon, and a small batch's noise looks like a few percent to save: more than
    # a 2% threshold; the gate's own 5% would hide what the buckets do) ...
    monkeypatch.setattr(payback, "MIN_SAVING", 0.02)
    blind = PaybackGate(RANKS, 40, 9, step_interval=100_000)
    assert blind.decide(_window(noisy.sum(dim=0, keepdim=True), committed), None) is not None
    # ... in their time buckets, they are noise: nothing is predicted to repay a move.
    gate = PaybackGate(RANKS, 40, 9, step_interval=100_000)
    assert gate.decide(_window(noisy, committed), None) is None
    assert gate.decisions[-1]["signal_share"] < 0.5
    # A real skew in the same buckets is still moved for.
    skewed = PaybackGate(RANKS, 40, 9, step_interval=100_000)
    assert skewed.decide(_window(_buckets(SKEWED, 1024, seed), committed), None) is not None
    assert skewed.decisions[-1]["signal_share"] > 0.95
