"""Device-agnostic ATen reference kernels: the oracle for every other kernel.

Rules these bodies keep, because they also run inside captured device graphs and are what an
inductor decomposition traces:
- no host sync (no ``.item()``, no data-dependent branch, no ``nonzero``/boolean masking);
- no Python loop over tokens and no data-dependent shapes;
- ``index_select``/``gather``/``scatter_add_`` instead of advanced indexing, which is orders of
  magnitude slower on CPU builds and lowers to worse device kernels.
"""

from __future__ import annotations

import torch

from eplb_graph.ops.checks import check_map_args, check_record_args

#: Knuth's multiplicative hash constant (floor(2**32 / golden ratio)); upstream vLLM's rule.
GOLDEN_HASH = 2654435769
_LOW32 = 0xFFFFFFFF
_LOW16 = 0xFFFF


def replica_hash(num_rows: int, offset: torch.Tensor) -> torch.Tensor:
    """``h[t] = ((t + offset) * 2654435769) mod 2**32`` as int64 ``[T]``.

    The product is split into 16-bit halves so no intermediate exceeds 2**49: int64 overflow is
    undefined behaviour in some device kernels and must not be relied on.
    """
    rows = torch.arange(num_rows, device=offset.device, dtype=torch.int64)
    x = (rows + offset) & _LOW32
    low = x & _LOW16
    high = x >> 16
    return (low * GOLDEN_HASH + (((high * GOLDEN_HASH) & _LOW16) << 16)) & _LOW32


def map_to_physical_ref(
    topk_ids: torch.Tensor,
    log2phy: torch.Tensor,
    replica_count: torch.Tensor,
    offset: torch.Tensor,
) -> torch.Tensor:
    """Logical ids ``[T, K]`` -> physical slots ``[T, K]`` (same dtype); invalid ids -> -1."""
    check_map_args(topk_ids, log2phy, replica_count, offset)
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
    # always populated in both the old and the new row, so fall back to it.
    first_replica = table.index_select(0, row_start)
    physical = torch.where(physical >= 0, physical, first_replica)
    physical = torch.where(valid, physical, torch.full_like(physical, -1))
    return physical.to(topk_ids.dtype).reshape(num_rows, top_k)


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
    num_rows = physical_ids.shape[0]
    num_slots = load.shape[0]
    rows = torch.arange(num_rows, device=load.device, dtype=torch.int64)
    row_counts = (rows < num_valid_tokens) & record_enabled
    ids = physical_ids.to(torch.int64)
    counted = row_counts.unsqueeze(1) & (ids >= 0) & (ids < num_slots)
    safe_ids = torch.where(counted, ids, torch.zeros_like(ids)).reshape(-1)
    load.scatter_add_(0, safe_ids, counted.reshape(-1).to(load.dtype))


def map_and_record_ref(
    topk_ids: torch.Tensor,
    log2phy: torch.Tensor,
    replica_count: torch.Tensor,
    offset: torch.Tensor,
    load: torch.Tensor,
    num_valid_tokens: torch.Tensor,
    record_enabled: torch.Tensor,
) -> torch.Tensor:
    """``map_to_physical`` followed by ``record_load`` of its result; returns the physical ids."""
    physical = map_to_physical_ref(topk_ids, log2phy, replica_count, offset)
    record_load_ref(load, physical, num_valid_tokens, record_enabled)
    return physical
