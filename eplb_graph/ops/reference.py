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

import torch

from eplb_graph.ops.checks import check_map_and_record_args, check_map_args, check_record_args

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


def map_to_physical_ref(
    topk_ids: torch.Tensor,
    log2phy: torch.Tensor,
    replica_count: torch.Tensor,
    offset: torch.Tensor,
) -> torch.Tensor:
    """Logical ids ``[T, K]`` -> physical slots ``[T, K]`` (same dtype); invalid ids -> -1."""
    check_map_args(topk_ids, log2phy, replica_count, offset)
    return _map_to_physical(topk_ids, log2phy, replica_count, offset)


def record_load_ref(
    load: torch.Tensor,
    physical_ids: torch.Tensor,
    num_valid_tokens: torch.Tensor,
    record_enabled: torch.Tensor,
) -> None:
    """Add one to ``load[physical_ids[t, k]]`` for every valid (t, k), in place.

    Row t counts iff ``record_enabled`` and ``t < num_valid_tokens``; ids outside ``[0, P)``
    (the -1 of an invalid logical id) never count. The flag is applied arithmetically, so a
    disabled step still runs the same kernels (graph-safe, no branch on device data).
    """
    check_record_args(load, physical_ids, num_valid_tokens, record_enabled)
    _record_load(load, physical_ids, num_valid_tokens, record_enabled)


def map_and_record_ref(
    topk_ids: torch.Tensor,
    log2phy: torch.Tensor,
    replica_count: torch.Tensor,
    offset: torch.Tensor,
    load: torch.Tensor,
    num_valid_tokens: torch.Tensor,
    record_enabled: torch.Tensor,
) -> torch.Tensor:
    """``map_to_physical`` followed by ``record_load`` of its result; returns the physical ids.

    Every input of both halves is checked first, so a bad ``load`` fails before anything runs.
    """
    check_map_and_record_args(
        topk_ids, log2phy, replica_count, offset, load, num_valid_tokens, record_enabled
    )
    physical = _map_to_physical(topk_ids, log2phy, replica_count, offset)
    _record_load(load, physical, num_valid_tokens, record_enabled)
    return physical
