"""Device-agnostic ATen reference kernels: the oracle for every other kernel.

Rules these bodies keep, because they also run inside captured device graphs and are what an
inductor decomposition traces:
- no host sync (no ``.item()``, no data-dependent branch, no ``nonzero``/boolean masking);
- no Python loop over tokens and no data-dependent shapes;
- ``index_select``/``gather``/``scatter_add_`` instead of advanced indexing, which is orders of
  magnitude slower on CPU builds and lowers to worse device kernels;
- no signed overflow in any intermediate: it is undefined behaviour in the C++ and device code
  inductor generates from these bodies, so a result that holds in eager might not hold compiled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from eplb_graph.ops.checks import (
    check_local_experts_args,
    check_local_experts_w8a8_args,
    check_map_and_record_args,
    check_map_args,
    check_record_args,
)
from eplb_graph.ops.signatures import MAPPED, checked_kernel

#: Knuth's multiplicative hash constant (floor(2**32 / golden ratio)); upstream vLLM's rule.
GOLDEN_HASH = 2654435769
_LOW32 = 0xFFFFFFFF
_LOW16 = 0xFFFF


def replica_hash(num_rows: int, offset: torch.Tensor) -> torch.Tensor:
    """``h[t] = ((t + offset) * 2654435769) mod 2**32`` as int64 ``[T]``.

    The offset is reduced mod 2**32 before the add and the product is split into 16-bit halves,
    so no intermediate exceeds 2**49 whatever the offset (``offset`` may be any int64).
    """
    rows = torch.arange(num_rows, device=offset.device, dtype=torch.int64)
    x = (rows + (offset & _LOW32)) & _LOW32
    low = x & _LOW16
    high = x >> 16
    return (low * GOLDEN_HASH + (((high * GOLDEN_HASH) & _LOW16) << 16)) & _LOW32


def _usable_slot(entry: torch.Tensor, table_dtype: torch.dtype, out_dtype: torch.dtype):
    """Where a table entry is a slot id the output can hold: ``0 <= entry <= max(out_dtype)``.

    A negative entry is padding (or garbage); one beyond the output dtype would wrap into an
    unrelated, valid-looking slot when cast. The upper bound costs a pass only when the table's
    dtype is wider than the output's.
    """
    usable = entry >= 0
    if torch.iinfo(table_dtype).max > torch.iinfo(out_dtype).max:
        usable = usable & (entry <= torch.iinfo(out_dtype).max)
    return usable


def _map_to_physical(
    topk_ids: torch.Tensor,
    log2phy: torch.Tensor,
    replica_count: torch.Tensor,
    offset: torch.Tensor,
) -> torch.Tensor:
    num_rows, top_k = topk_ids.shape
    num_experts, width = log2phy.shape
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < num_experts)
    safe_ids = torch.where(valid, ids, torch.zeros_like(ids))
    count = replica_count.to(torch.int64).index_select(0, safe_ids).clamp_min(1)
    row_hash = replica_hash(num_rows, offset).unsqueeze(1).expand(num_rows, top_k).reshape(-1)
    # The clamp keeps the column inside the table even if a count exceeds the table width.
    replica = torch.remainder(row_hash, count).clamp_max(width - 1)
    table = log2phy.reshape(-1).to(torch.int64)
    row_start = safe_ids * width
    physical = table.index_select(0, row_start + replica)
    # A torn refresh (new count, old row) can point at a -1 pad; replica 0 of a valid expert is
    # always populated in both the old and the new row, so fall back to it. An entry that is no
    # usable slot even there maps to -1, like an invalid id: never to a wrapped or negative id.
    first_replica = table.index_select(0, row_start)
    physical = torch.where(
        _usable_slot(physical, log2phy.dtype, topk_ids.dtype), physical, first_replica
    )
    keep = valid & _usable_slot(physical, log2phy.dtype, topk_ids.dtype)
    physical = torch.where(keep, physical, torch.full_like(physical, -1))
    return physical.to(topk_ids.dtype).reshape(num_rows, top_k)


def _record_load(
    load: torch.Tensor,
    physical_ids: torch.Tensor,
    num_valid_tokens: torch.Tensor,
    record_enabled: torch.Tensor,
) -> None:
    num_rows = physical_ids.shape[0]
    num_slots = load.shape[0]
    rows = torch.arange(num_rows, device=load.device, dtype=torch.int64)
    row_counts = (rows < num_valid_tokens) & record_enabled
    ids = physical_ids.to(torch.int64)
    counted = row_counts.unsqueeze(1) & (ids >= 0) & (ids < num_slots)
    safe_ids = torch.where(counted, ids, torch.zeros_like(ids)).reshape(-1)
    load.scatter_add_(0, safe_ids, counted.reshape(-1).to(load.dtype))


def map_then_record(
    map_fn: Callable[..., torch.Tensor], record_fn: Callable[..., None]
) -> Callable[..., torch.Tensor]:
    """``map_and_record`` from a device's map and record formulations: map, record the result.

    Why composed here: every unfused kernel splits the fused op's arguments the same way.
    """

    def compute(*args: torch.Tensor) -> torch.Tensor:
        physical = map_fn(*args[:MAPPED])
        record_fn(args[MAPPED], physical, *args[MAPPED + 1 :])
        return physical

    return compute


map_to_physical_ref = checked_kernel(
    "map_to_physical",
    check_map_args,
    _map_to_physical,
    __name__,
    "map_to_physical_ref",
    """Logical ids ``[T, K]`` -> physical slots ``[T, K]`` (same dtype); invalid ids -> -1.""",
)

record_load_ref = checked_kernel(
    "record_load",
    check_record_args,
    _record_load,
    __name__,
    "record_load_ref",
    """Add one to ``load[physical_ids[t, k]]`` for every valid (t, k), in place.

    Row t counts iff ``record_enabled`` and ``t < num_valid_tokens``; ids outside ``[0, P)``
    (the -1 of an invalid logical id) never count. The flag is applied arithmetically, so a
    disabled step still runs the same kernels (graph-safe, no branch on device data).
    """,
)

map_and_record_ref = checked_kernel(
    "map_and_record",
    check_map_and_record_args,
    map_then_record(_map_to_physical, _record_load),
    __name__,
    "map_and_record_ref",
    """``map_to_physical`` followed by ``record_load`` of its result; returns the physical ids.

    Every input of both halves is checked first, so a bad ``load`` fails before anything runs.
    """,
)


# -- expert compute ------------------------------------------------------------------------------
# The oracle computes every local expert densely over all T rows and keeps the rows routed to it
# (a Python loop over the static E and K, no data-dependent shape): work proportional to E * T,
# not to the local rows. It is the definition, not the fast path; the native CPU kernel is.


def _local_rows(slots, slot_to_local, num_experts, num_valid_tokens):
    """(computed [T, K] bool, local expert [T, K] int64): which (t, k) rows this rank computes.

    Row (t, k) is computed iff ``t < num_valid_tokens``, ``0 <= slots[t, k] < P`` and
    ``0 <= slot_to_local[slots[t, k]] < E``; everything else (slot -1, another rank's slot, a
    padding row, an out-of-range value) contributes nothing.
    """
    num_rows, top_k = slots.shape
    num_slots = slot_to_local.shape[0]
    ids = slots.to(torch.int64)
    rows = torch.arange(num_rows, device=slots.device, dtype=torch.int64)
    valid = (rows < num_valid_tokens).unsqueeze(1) & (ids >= 0) & (ids < num_slots)
    if num_slots == 0:
        return valid, torch.full_like(ids, -1)
    safe = torch.where(valid, ids, torch.zeros_like(ids)).reshape(-1)
    local = slot_to_local.to(torch.int64).index_select(0, safe).reshape(num_rows, top_k)
    computed = valid & (local >= 0) & (local < num_experts)
    return computed, local


def _swiglu(x, w13, w2):
    """``W2 (silu(G x) * U x)`` for rows ``x [M, H]``; the product is formed in float32 and
    rounded once to x's dtype (what the native kernel does)."""
    gate_up = x @ w13.t()
    inner = w13.shape[0] // 2
    act = F.silu(gate_up[:, :inner].float()) * gate_up[:, inner:].float()
    return act.to(x.dtype) @ w2.t()


def quantize_rows(x):
    """Per-row symmetric int8 quantization (values kept as float32 integers) and the scales."""
    scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.round(x / scale).clamp(-127, 127), scale


def _swiglu_w8a8(x, w13, w2, w13_scale, w2_scale):
    """The demo's W8A8 expert: activations quantized per row, int8 weights, fp32 scales; the
    integer products are summed in float32, exact while |sum| < 2**24."""
    x_q, x_scale = quantize_rows(x.float())
    gate_up = (x_q @ w13.float().t()) * x_scale * w13_scale
    gate, value = gate_up.chunk(2, dim=1)
    inner_q, inner_scale = quantize_rows(F.silu(gate) * value)
    return (inner_q @ w2.float().t()) * inner_scale * w2_scale


def _combine_experts(hidden, slots, topk_weights, slot_to_local, stats, num_valid, woi, expert):
    """out[t] = sum_k over computed rows of w_tk * expert_e(x_t) (or expert_e(w_tk x_t))."""
    num_experts = expert.num_experts
    computed, local = _local_rows(slots, slot_to_local, num_experts, num_valid)
    weights = topk_weights.float()
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in range(num_experts):
        dense = None if woi else expert(e, hidden).float()
        for k in range(slots.shape[1]):
            mine = (computed[:, k] & (local[:, k] == e)).unsqueeze(1)
            w = weights[:, k].unsqueeze(1)
            if woi:
                contribution = expert(e, (hidden.float() * w).to(hidden.dtype)).float()
            else:
                contribution = dense * w
            out = out + torch.where(mine, contribution, torch.zeros_like(contribution))
    # The reference cannot time itself without a host sync: it counts rows (and active local
    # experts, where stats has that cell) and adds 0 ns.
    rows = computed.sum().to(torch.int64)
    counts = [rows, torch.zeros_like(rows)]
    if stats.shape[0] == 3:
        used = torch.zeros(num_experts + 1, dtype=torch.int64, device=hidden.device)
        used.index_add_(0, torch.where(computed, local, num_experts).reshape(-1).long(),
                        torch.ones_like(local, dtype=torch.int64).reshape(-1))  # fmt: skip
        counts.append((used[:num_experts] > 0).sum().to(torch.int64))
    stats.add_(torch.stack(counts))
    return out.to(hidden.dtype)


class _Unquantized:
    def __init__(self, w13, w2):
        self.w13, self.w2, self.num_experts = w13, w2, w13.shape[0]

    def __call__(self, e, x):
        return _swiglu(x, self.w13[e], self.w2[e])


class _W8A8:
    def __init__(self, w13, w2, w13_scale, w2_scale):
        self.w13, self.w2, self.num_experts = w13, w2, w13.shape[0]
        self.w13_scale, self.w2_scale = w13_scale, w2_scale

    def __call__(self, e, x):
        return _swiglu_w8a8(x, self.w13[e], self.w2[e], self.w13_scale[e], self.w2_scale[e])


def _experts(expert_type: type) -> Callable[..., torch.Tensor]:
    """Both expert ops' oracle: the weights (and scales) between ``slot_to_local`` and ``stats``,
    the schemas' only difference, build ``expert_type``."""

    def compute(*args) -> torch.Tensor:
        hidden, slots, topk_weights, slot_to_local, *weights = args[:-3]
        stats, num_valid_tokens, weight_on_input = args[-3:]
        return _combine_experts(
            hidden,
            slots,
            topk_weights,
            slot_to_local,
            stats,
            num_valid_tokens,
            weight_on_input,
            expert_type(*weights),
        )

    return compute


local_experts_ref = checked_kernel(
    "local_experts",
    check_local_experts_args,
    _experts(_Unquantized),
    __name__,
    "local_experts_ref",
    """The oracle of ``local_experts`` (semantics: :func:`eplb_graph.ops.local_experts`).""",
)

local_experts_w8a8_ref = checked_kernel(
    "local_experts_w8a8",
    check_local_experts_w8a8_args,
    _experts(_W8A8),
    __name__,
    "local_experts_w8a8_ref",
    """The oracle of ``local_experts_w8a8``.

    Semantics: :func:`eplb_graph.ops.local_experts_w8a8`.
    """,
)
