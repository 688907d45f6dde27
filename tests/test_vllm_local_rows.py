"""``eplb_graph::vllm_local_experts``: vLLM's own CPU kernel on only this rank's rows.

Against the former weight-0 path (all ``T x K`` rows through vLLM's kernel) and a plain torch
SwiGLU reference; the stats row counts exactly the local rows; it compiles with 0 graph breaks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eplb_graph.integrations.vllm.expert_parallel import to_local
from eplb_graph.integrations.vllm.local_rows import LocalRowsError, vllm_local_experts

ops = pytest.importorskip("vllm._custom_ops")  # the vllm extra is installed in CI

E_GLOBAL, E_LOCAL, H, INTER, K = 8, 4, 64, 32, 2


def _setup(dtype, isa, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E_LOCAL, 2 * INTER, H, generator=gen).to(dtype) / 8
    w2 = torch.randn(E_LOCAL, H, INTER, generator=gen).to(dtype) / 8
    packed = [ops.cpu_prepack_moe_weight(w13, isa), ops.cpu_prepack_moe_weight(w2, isa)]
    # slots 2..5 live here (rows 0..3), the rest elsewhere
    expert_map = torch.full((E_GLOBAL,), -1, dtype=torch.int32)
    expert_map[2:6] = torch.arange(E_LOCAL, dtype=torch.int32)
    return w13, w2, packed, expert_map


def _reference(hidden, ids, weights, w13, w2, expert_map, on_input=False):
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            row = int(expert_map[ids[t, k]])
            if row < 0:
                continue
            x = hidden[t].float() * (weights[t, k].float() if on_input else 1.0)
            gate, up = (w13[row].float() @ x).chunk(2)
            y = w2[row].float() @ (F.silu(gate) * up)
            out[t] += y if on_input else weights[t, k].float() * y
    return out


@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_matches_weight_zero_path_and_counts_local_rows(tokens):
    w13, w2, packed, expert_map = _setup(torch.float32, "vec", seed=tokens)
    gen = torch.Generator().manual_seed(100 + tokens)
    hidden = torch.randn(tokens, H, generator=gen)
    ids = torch.randint(0, E_GLOBAL, (tokens, K), generator=gen, dtype=torch.int32)
    weights = torch.rand(tokens, K, generator=gen)
    stats = torch.zeros(2, dtype=torch.int64)
    out = vllm_local_experts(hidden, ids, weights, expert_map, [*packed, None, None], stats)
    local_ids, local_weights = to_local(ids, weights, expert_map)
    old = torch.empty_like(hidden)
    ops.cpu_fused_moe(old, hidden, *packed, None, None, local_weights, local_ids, "silu", "vec")
    torch.testing.assert_close(out, old, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, _reference(hidden, ids, weights, w13, w2, expert_map))
    assert int(stats[0]) == int((expert_map[ids.long()] >= 0).sum())
    assert int(stats[1]) > 0
    before = stats.clone()
    vllm_local_experts(hidden, ids, weights, expert_map, [*packed, None, None], stats)
    assert int(stats[0]) == 2 * int(before[0])  # accumulates: the host reads deltas


def test_no_local_rows_computes_nothing_and_returns_zeros():
    _, _, packed, expert_map = _setup(torch.float32, "vec")
    ids = torch.tensor([[0, 1], [6, 7]], dtype=torch.int32)
    stats = torch.zeros(2, dtype=torch.int64)
    out = vllm_local_experts(
        torch.randn(2, H), ids, torch.rand(2, K), expert_map, [*packed, None, None], stats
    )
    assert torch.count_nonzero(out) == 0 and int(stats[0]) == 0


def test_weight_on_input_excludes_other_ranks_rows():
    """Llama-4 style (top-1, weight folded into the input): the kernel ignores topk_weights, so
    the weight-0 trick would add other ranks' experts; row exclusion does not."""
    w13, w2, packed, expert_map = _setup(torch.float32, "vec")
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(9, H, generator=gen)
    ids = torch.randint(0, E_GLOBAL, (9, 1), generator=gen, dtype=torch.int32)
    weights = torch.rand(9, 1, generator=gen)
    stats = torch.zeros(2, dtype=torch.int64)
    weighted = hidden * weights  # what vLLM's prepare() hands the experts
    out = vllm_local_experts(
        weighted, ids, weights, expert_map, [*packed, None, None], stats, weight_on_input=True
    )
    ref = _reference(hidden, ids, weights, w13, w2, expert_map, on_input=True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    nonlocal_tokens = expert_map[ids[:, 0].long()] < 0
    assert nonlocal_tokens.any() and torch.count_nonzero(out[nonlocal_tokens]) == 0


def test_bfloat16_kernel():
    """bf16 runs X86CPUUnquantizedExperts (AMX) where the CPU has AMX, else the vec kernel."""
    isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
    w13, w2, packed, expert_map = _setup(torch.bfloat16, isa)
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(12, H, generator=gen).bfloat16()
    ids = torch.randint(0, E_GLOBAL, (12, K), generator=gen, dtype=torch.int32)
    weights = torch.rand(12, K, generator=gen)
    stats = torch.zeros(2, dtype=torch.int64)
    out = vllm_local_experts(
        hidden, ids, weights, expert_map, [*packed, None, None], stats, isa=isa
    )
    assert out.dtype == torch.bfloat16
    ref = _reference(hidden, ids, weights, w13, w2, expert_map)
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)
    assert int(stats[0]) == int((expert_map[ids.long()] >= 0).sum())


def test_compiles_fullgraph_and_keeps_counting():
    _, _, packed, expert_map = _setup(torch.float32, "vec")
    stats = torch.zeros(2, dtype=torch.int64)
    torch._dynamo.reset()

    def step(hidden, ids, weights):
        return vllm_local_experts(hidden, ids, weights, expert_map, [*packed, None, None], stats)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    eager_stats_rows = 0
    for tokens in (5, 9):
        hidden = torch.randn(tokens, H)
        ids = torch.randint(0, E_GLOBAL, (tokens, K), dtype=torch.int32)
        weights = torch.rand(tokens, K)
        torch.testing.assert_close(compiled(hidden, ids, weights), step(hidden, ids, weights))
        eager_stats_rows += 2 * int((expert_map[ids.long()] >= 0).sum())
    assert int(stats[0]) == eager_stats_rows


def test_unknown_kernel_is_a_typed_error():
    _, _, packed, expert_map = _setup(torch.float32, "vec")
    with pytest.raises(LocalRowsError, match="kernel"):
        vllm_local_experts(
            torch.randn(2, H),
            torch.zeros(2, K, dtype=torch.int32),
            torch.rand(2, K),
            expert_map,
            [*packed, None, None],
            torch.zeros(2, dtype=torch.int64),
            kernel="nope",
        )
