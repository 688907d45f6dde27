"""The ops on a CUDA device: the ATen reference kernels (eager) and their inductor decomposition
(Triton) give what the CPU kernel gives, for every rule of the op contract.

These need a GPU; without one they skip with the reason (``pytest -rs``), and
``tools/device_check.py`` runs them (``-m cuda``) on the lent device.
"""

from __future__ import annotations

import pytest
import torch

import eplb_graph
from eplb_graph import ops
from tests.routing_contract import check_against_reference, op_record, op_route

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NUM_EXPERTS, NUM_REDUNDANT, NUM_RANKS = 16, 16, 4


def _state(device: str, index_dtype: torch.dtype, seed: int) -> eplb_graph.EplbState:
    generator = torch.Generator().manual_seed(seed)
    row = torch.cat(
        [
            torch.arange(NUM_EXPERTS),
            torch.randint(0, NUM_EXPERTS, (NUM_REDUNDANT,), generator=generator),
        ]
    )
    row = row[torch.randperm(row.numel(), generator=generator)]
    placement = eplb_graph.Placement(row.unsqueeze(0), NUM_EXPERTS, NUM_RANKS)
    return eplb_graph.EplbState(
        placement, device=device, index_dtype=index_dtype, load_dtype=index_dtype
    )


def _ids(tokens: int, top_k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Logical ids with some out of range on both sides (they must map to -1, uncounted)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-2, NUM_EXPERTS + 2, (tokens, top_k), generator=generator).to(dtype)


def _route(state: eplb_graph.EplbState, ids: torch.Tensor) -> torch.Tensor:
    """``map_and_record`` of ``ids`` through layer 0 of ``state`` (its live tables)."""
    layer = state.layer(0)
    return ops.map_and_record(ids, layer.log2phy, layer.replica_count, state.offset, layer.load,
                              state.num_valid_tokens, state.record_enabled)  # fmt: skip


def _routed(device: str, dtype: torch.dtype, tokens: int, valid: int, offset: int, seed: int):
    state = _state(device, dtype, seed)
    state.set_step_inputs_(valid, True)
    state.offset.fill_(offset)
    ids = _ids(tokens, 4, dtype, seed).to(device)
    layer = state.layer(0)
    physical = _route(state, ids)
    return physical.cpu(), layer.load.cpu()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    ("tokens", "valid", "offset"), [(1, 1, 0), (37, 30, 2**40 + 5), (513, 0, 7)]
)
def test_map_and_record_on_cuda_equals_cpu(dtype, tokens, valid, offset):
    got = _routed("cuda", dtype, tokens, valid, offset, seed=tokens)
    expected = _routed("cpu", dtype, tokens, valid, offset, seed=tokens)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])
    assert int(got[1].sum()) == int((expected[0][:valid] >= 0).sum())


def test_cuda_kernels_follow_every_rule_of_the_reference():
    """The registered CUDA kernels (Triton) against the reference on the same GPU, case by
    case (``tests/routing_contract.py``)."""
    assert check_against_reference(op_route, op_record, "cuda") == 80


def test_map_to_physical_and_record_load_on_cuda_equal_the_fused_op():
    state = _state("cuda", torch.int64, seed=3)
    state.set_step_inputs_(20, True)
    ids = _ids(24, 4, torch.int64, seed=3).cuda()
    layer = state.layer(0)
    physical = ops.map_to_physical(ids, layer.log2phy, layer.replica_count, state.offset)
    ops.record_load(layer.load, physical, state.num_valid_tokens, state.record_enabled)
    split_load = layer.load.clone()
    layer.load.zero_()
    fused = _route(state, ids)
    assert torch.equal(fused, physical)
    assert torch.equal(layer.load, split_load)


def test_local_experts_on_cuda_equals_cpu():
    generator = torch.Generator().manual_seed(11)
    tokens, hidden, inner, slots, experts = 19, 32, 48, 12, 6
    x = torch.randn(tokens, hidden, generator=generator)
    chosen = torch.randint(-1, slots, (tokens, 2), generator=generator)
    weights = torch.rand(tokens, 2, generator=generator)
    slot_to_local = torch.full((slots,), -1, dtype=torch.int64)
    slot_to_local[:experts] = torch.arange(experts)
    w13 = torch.randn(experts, 2 * inner, hidden, generator=generator) / hidden**0.5
    w2 = torch.randn(experts, hidden, inner, generator=generator) / inner**0.5
    results = {}
    for device in ("cpu", "cuda"):
        stats = torch.zeros(3, dtype=torch.int64, device=device)
        args = [t.to(device) for t in (x, chosen, weights, slot_to_local, w13, w2)]
        valid = torch.tensor(15, device=device)
        results[device] = (ops.local_experts(*args, stats, valid).cpu(), stats.cpu())
    torch.testing.assert_close(results["cuda"][0], results["cpu"][0], rtol=1e-4, atol=1e-4)
    assert results["cuda"][1][0] == results["cpu"][1][0]  # rows computed
    assert results["cuda"][1][2] == results["cpu"][1][2]  # active local experts


def test_inductor_on_cuda_routes_and_counts_like_eager():
    """On CUDA inductor decomposes the routing op into the reference (Triton kernels); the
    compiled routing and load must equal eager exactly, across an in-place commit."""
    state = _state("cuda", torch.int64, seed=5)
    state.set_step_inputs_(40, True)
    ids = _ids(48, 4, torch.int64, seed=5).cuda()
    layer = state.layer(0)

    def route(ids):
        return _route(state, ids)

    torch._dynamo.reset()
    compiled = torch.compile(route, backend="inductor", fullgraph=True)
    for commit_seed in (6, 7):
        state.commit_(_state("cpu", torch.int64, seed=commit_seed).placement)
        state.reset_load_()
        got = compiled(ids)
        got_load = layer.load.clone()
        state.reset_load_()
        expected = route(ids)
        assert torch.equal(got, expected)
        assert torch.equal(got_load, layer.load)
    torch._dynamo.reset()
