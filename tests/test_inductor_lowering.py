"""Pins how inductor lowers the routing ops (private decomposition API; re-check on upgrades).

CPU with the native kernel: the op stays one extern call (already a fused single pass). Elsewhere
(no native kernel, other devices): the op is decomposed into the ATen reference so inductor can
fuse it, and the compiled result still equals eager, load included.
"""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import eplb_graph
from eplb_graph.ops import inductor as lowering
from eplb_graph.ops import native


def _routed(state: eplb_graph.EplbState):
    def fn(ids):
        physical = torch.ops.eplb_graph.map_and_record(
            ids,
            state.log2phy[0],
            state.replica_count[0],
            state.offset,
            state.load[0],
            state.num_valid_tokens,
            state.record_enabled,
        )
        return physical * 2 + 1  # a neighbour inductor can fuse with a decomposed op

    return fn


def _state() -> eplb_graph.EplbState:
    state = eplb_graph.EplbState(eplb_graph.Placement.default(1, 16, 16, 4), rank=2)
    state.set_step_inputs_(48, True)
    return state


def _compile_and_compare(state, ids):
    fn = _routed(state)
    torch._dynamo.reset()
    state.reset_load_()
    expected = fn(ids)
    eager_load = state.load.clone()
    state.reset_load_()
    # The FX graph cache keys on the graph, not on the lowering decision: bypass it so each test
    # sees its own lowering.
    with torch._inductor.config.patch(fx_graph_cache=False):
        got, code = run_and_get_code(torch.compile(fn, backend="inductor", fullgraph=True), ids)
    assert torch.equal(got, expected)
    assert torch.equal(state.load, eager_load)
    return "\n".join(code)


def test_native_cpu_kernel_stays_one_extern_call_under_inductor():
    if not native.ensure_loaded():
        pytest.fail(f"native CPU kernel unavailable: {native.failure_reason()}")
    ids = torch.randint(-2, 18, (64, 4))
    code = _compile_and_compare(_state(), ids)
    assert code.count("= torch.ops.eplb_graph.map_and_record.default(") == 1


def test_other_devices_get_a_fusable_decomposition(monkeypatch):
    monkeypatch.setattr(lowering, "keep_opaque", lambda device: False)
    ids = torch.randint(-2, 18, (64, 4))
    code = _compile_and_compare(_state(), ids)
    assert "eplb_graph.map_and_record" not in code
    # The decomposed body is plain loops: the gather, remainder and scatter show up in kernels.
    assert "cpp_fused" in code
