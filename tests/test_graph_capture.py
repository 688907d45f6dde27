"""Graph-capture regression suite: compiled and captured routing follows in-place commits.

Pins invariants 3 (lookup changes only on commit), 4 (padding and invalid ids not counted, under
compile too) and 9 (no graph break, no recompile, stable addresses) on every backend.
"""

from __future__ import annotations

import pytest
import torch

import eplb_graph
from eplb_graph.models import TinyMoE, TinyMoEConfig
from eplb_graph.testing import (
    GraphRegressionError,
    StepInputs,
    capture_commit_replay,
    graph_mode_skip_reason,
)

COMPILE_BACKENDS = ["eager", "aot_eager", "inductor"]
CONFIG = TinyMoEConfig(num_layers=2, hidden=16, intermediate=24, num_experts=8, top_k=2)
NUM_REDUNDANT, NUM_RANKS, TOKENS = 8, 4, 12


def _placements(count: int, seed: int = 1) -> list[eplb_graph.Placement]:
    """Distinct valid placements: every expert once, redundant slots to random experts."""
    generator = torch.Generator().manual_seed(seed)
    result = []
    for _ in range(count):
        rows = []
        for _layer in range(CONFIG.num_layers):
            extra = torch.randint(0, CONFIG.num_experts, (NUM_REDUNDANT,), generator=generator)
            row = torch.cat([torch.arange(CONFIG.num_experts), extra])
            rows.append(row[torch.randperm(len(row), generator=generator)])
        result.append(eplb_graph.Placement(torch.stack(rows), CONFIG.num_experts, NUM_RANKS))
    return result


def _model(device: str = "cpu") -> tuple[TinyMoE, eplb_graph.EplbState]:
    placement = eplb_graph.Placement.default(
        CONFIG.num_layers, CONFIG.num_experts, NUM_REDUNDANT, NUM_RANKS
    )
    state = eplb_graph.EplbState(placement, device=device, rank=1)
    return TinyMoE(CONFIG, state), state


class _RoutedMoE(torch.nn.Module):
    """TinyMoE whose slot weights follow every commit (what the movement plane guarantees)."""

    def __init__(self, model: TinyMoE) -> None:
        super().__init__()
        self.model = model

    def forward(self, hidden):
        return self.model(hidden)


def _install_weights_on_commit(state: eplb_graph.EplbState, model: TinyMoE) -> None:
    commit = state.commit_

    def commit_with_weights(placement):
        commit(placement)
        model.install_placement_weights_()

    state.commit_ = commit_with_weights  # type: ignore[method-assign]


STEP_KNOBS = [
    StepInputs(num_valid_tokens=TOKENS, record=True, offset_advance=1),
    StepInputs(num_valid_tokens=5, record=True, offset_advance=3),  # padding rows 5..11
    StepInputs(num_valid_tokens=TOKENS, record=False, offset_advance=1),
    StepInputs(num_valid_tokens=0, record=True, offset_advance=7),
]


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_invariant9_compiled_moe_follows_in_place_commits_without_recompile(backend):
    model, state = _model()
    _install_weights_on_commit(state, model)
    hidden = torch.randn(TOKENS, CONFIG.hidden, generator=torch.Generator().manual_seed(3))
    report = capture_commit_replay(
        model,
        (hidden,),
        state,
        _placements(4),
        mode=f"compile:{backend}",
        step_inputs=STEP_KNOBS,
        atol=1e-5,
    )
    assert report.commits == 4
    assert report.replays == 4 * len(STEP_KNOBS)


@pytest.mark.parametrize("backend", COMPILE_BACKENDS)
def test_zero_graph_breaks_in_routed_moe(backend):
    model, _state = _model()
    hidden = torch.randn(TOKENS, CONFIG.hidden)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(hidden)
    assert explanation.graph_count == 1
    assert explanation.break_reasons == []
    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(hidden)  # raises on any break


def test_invariant3_routing_changes_only_when_committed():
    """Between commits the compiled routing is frozen; after a commit it follows the new table."""
    model, state = _model()
    hidden = torch.randn(TOKENS, CONFIG.hidden)
    state.set_step_inputs_(TOKENS, True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    compiled(hidden)
    state.reset_load_()
    compiled(hidden)
    load_before = state.load.clone()
    # Host-side placement objects are values: building one changes nothing on the device.
    new_placement = _placements(1, seed=9)[0]
    state.reset_load_()
    compiled(hidden)
    assert torch.equal(state.load, load_before)
    state.commit_(new_placement)
    state.reset_load_()
    compiled(hidden)
    # Load now lands only on slots that hold, in the new placement, experts the router picked.
    used = state.load > 0
    assert not torch.equal(state.load, load_before)
    for layer in range(CONFIG.num_layers):
        slots = used[layer].nonzero().flatten()
        assert torch.all(state.log2phy[layer].flatten().unsqueeze(0).eq(slots.unsqueeze(1)).any(1))


def test_invariant4_padding_rows_not_counted_under_compile():
    model, state = _model()
    hidden = torch.randn(TOKENS, CONFIG.hidden)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    torch._dynamo.reset()
    for valid in (TOKENS, 7, 0):
        state.reset_load_()
        state.set_step_inputs_(valid, True)
        compiled(hidden)
        assert state.load.sum(dim=1).tolist() == [valid * CONFIG.top_k] * CONFIG.num_layers


def test_helper_detects_a_recompile_caused_by_a_rebinding_commit():
    """Negative control: replacing a table with a different shape must be caught."""
    model, state = _model()
    hidden = torch.randn(TOKENS, CONFIG.hidden)
    original_commit = state.commit_

    def rebinding_commit(placement):
        original_commit(placement)
        state.log2phy = torch.cat([state.log2phy, state.log2phy[..., :1]], dim=-1).contiguous()

    state.commit_ = rebinding_commit  # type: ignore[method-assign]
    with pytest.raises((GraphRegressionError, RuntimeError)):
        capture_commit_replay(
            model, (hidden,), state, _placements(2), mode="compile:eager", atol=1e-5
        )


def test_helper_detects_routing_that_ignores_commits():
    """Negative control: a model that snapshots its lookup at build time disagrees with eager."""
    model, state = _model()
    frozen_log2phy = state.log2phy.clone()

    def stale(hidden):
        saved = state.log2phy
        state.log2phy = frozen_log2phy
        try:
            return model(hidden)
        finally:
            state.log2phy = saved

    hidden = torch.randn(TOKENS, CONFIG.hidden)
    eager_state_model = model
    with pytest.raises(GraphRegressionError):
        capture_commit_replay(
            lambda h: stale(h) if torch.compiler.is_compiling() else eager_state_model(h),
            (hidden,),
            state,
            _placements(2),
            mode="compile:eager",
        )


DEVICE_MODES = {
    "cuda_graph": "cuda",
    "npu_graph": "npu",
}


@pytest.mark.parametrize("mode", [pytest.param("cuda_graph", marks=pytest.mark.cuda), "npu_graph"])
def test_device_graph_capture_commit_replay(mode):
    """Same body for CUDA graphs and NPU graphs: capture once, commit in place, replay."""
    reason = graph_mode_skip_reason(mode)
    if reason is not None:
        pytest.skip(reason)
    model, state = _model(device=DEVICE_MODES[mode])
    hidden = torch.randn(TOKENS, CONFIG.hidden, device=DEVICE_MODES[mode])
    _install_weights_on_commit(state, model)
    report = capture_commit_replay(
        model,
        (hidden,),
        state,
        _placements(3),
        mode=mode,
        step_inputs=STEP_KNOBS,
        atol=1e-4,
    )
    assert report.replays == 3 * len(STEP_KNOBS)
