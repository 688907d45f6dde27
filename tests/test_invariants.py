"""Named pins for brief invariants 2, 7 and 9 that are not op-semantics properties."""

from __future__ import annotations

import pytest
import torch

import eplb_graph
from eplb_graph.models import TinyMoE, TinyMoEConfig

CONFIG = TinyMoEConfig(num_layers=2, hidden=16, intermediate=24, num_experts=8, top_k=2)


def _model() -> tuple[TinyMoE, eplb_graph.EplbState]:
    placement = eplb_graph.Placement.default(CONFIG.num_layers, CONFIG.num_experts, 8, 4)
    state = eplb_graph.EplbState(placement)
    return TinyMoE(CONFIG, state), state


def test_invariant2_experts_selected_once_and_compute_reads_physical_slots():
    """One routing op per layer in the graph, and the output depends on the slot's weights."""
    model, state = _model()
    hidden = torch.randn(10, CONFIG.hidden, generator=torch.Generator().manual_seed(0))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    state.set_step_inputs_(10, True)
    torch.compile(model, backend=backend, fullgraph=True)(hidden)
    routing_calls = [
        node
        for node in graphs[0].graph.nodes
        if node.op == "call_function" and "eplb_graph" in str(node.target)
    ]
    assert len(routing_calls) == CONFIG.num_layers
    assert all("map_and_record" in str(node.target) for node in routing_calls)

    baseline = model(hidden)
    state.reset_load_()
    model(hidden)
    used = (state.load[0] > 0).nonzero().flatten()
    with torch.no_grad():
        model.slot_up[0, used[0]].mul_(-1.0)  # corrupt one slot that routing actually used
    assert not torch.allclose(model(hidden), baseline)


def test_invariant7_unsupported_state_configurations_fail_at_initialization():
    placement = eplb_graph.Placement.default(2, 8, 8, 4)
    with pytest.raises(TypeError, match=r"index_dtype must be torch\.int32 or torch\.int64"):
        eplb_graph.EplbState(placement, index_dtype=torch.float32)
    with pytest.raises(TypeError, match=r"load_dtype must be torch\.int32 or torch\.int64"):
        eplb_graph.EplbState(placement, load_dtype=torch.int16)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\)"):
        eplb_graph.EplbState(placement, rank=4)
    with pytest.raises(eplb_graph.PlacementError, match="R=1"):
        eplb_graph.EplbState(placement, max_replicas=1)
    with pytest.raises(ValueError, match="layers x"):
        TinyMoE(TinyMoEConfig(num_experts=16), eplb_graph.EplbState(placement))


def test_invariant9_every_state_tensor_is_a_static_graph_input():
    """cudagraph trees and npugraph_ex treat static inputs as fixed addresses (no copy, no
    re-capture); every EPLB tensor the graph reads must be one."""
    model, state = _model()
    seen: dict[str, str | None] = {}
    by_pointer = {ptr: name for name, ptr in state.data_ptrs().items()}

    def backend(gm, example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, example in zip(placeholders, example_inputs, strict=True):
            name = by_pointer.get(getattr(example, "data_ptr", lambda: None)())
            if name is not None:
                seen[name] = node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(4, CONFIG.hidden))
    read_by_graph = {
        "log2phy",
        "replica_count",
        "load",
        "offset",
        "num_valid_tokens",
        "record_enabled",
    }
    assert set(seen) == read_by_graph
    assert all(kind is not None for kind in seen.values()), seen
