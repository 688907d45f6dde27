"""Triton kernels of the routing ops for CUDA devices: one launch per call.

Why: the ATen reference is the oracle, and on a GPU it is some thirty small kernels (hash,
clamps, gathers, fallbacks, the scatter): 690 us per eager call and 57 us per call inside a
captured graph on an H200, against 12 us and 4 us for a bare ``index_select`` (the first run of
``tools/device_check.py``, docs/benchmarks-log.md). Here every (token, k) element is one lane: it
hashes its row, reads its expert's count and table entry, applies the reference's fallbacks,
writes its slot and, when counted, adds one to the load with an atomic. The rules are the
reference's (``eplb_graph/ops/reference.py``), element by element:

- ``h = ((t + offset) * 2654435769) mod 2**32`` from 16-bit halves (no intermediate beyond
  2**49, whatever the offset), ``replica = min(h % max(count, 1), R - 1)``;
- an id outside ``[0, N)`` maps to -1; a chosen entry that is negative or beyond the output
  dtype falls back to replica 0, and to -1 if that is no usable slot either;
- row t counts iff ``record_enabled`` and ``t < num_valid_tokens``, once per slot in ``[0, P)``.

Imported only when a CUDA tensor reaches the op (``eplb_graph.ops.cuda``), so a CPU-only
process never imports triton. ``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors,
which is how the CPU suite checks them against the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eplb_graph.ops.reference import GOLDEN_HASH

BLOCK = 1024
# Globals a jit function reads must be constexpr.
_GOLDEN = tl.constexpr(GOLDEN_HASH)
_LOW16 = tl.constexpr(0xFFFF)
_LOW32 = tl.constexpr(0xFFFFFFFF)


@triton.jit
def _hash_rows(rows, offset):
    """``((rows + offset) * 2654435769) mod 2**32`` as int64, via 16-bit halves."""
    x = (rows + (offset & _LOW32)) & _LOW32
    low = x & _LOW16
    high = x >> 16
    return (low * _GOLDEN + (((high * _GOLDEN) & _LOW16) << 16)) & _LOW32


@triton.jit
def _counted_rows(valid_ptr, record_ptr):
    """Rows below this count: ``num_valid_tokens``, or none when recording is off. The flag is
    folded into the bound (0 or 1 times it) rather than and-ed in as a scalar bool: the same
    on the GPU, and what Triton's interpreter (the CPU tests) can mask an atomic with."""
    return tl.load(valid_ptr).to(tl.int64) * tl.load(record_ptr).to(tl.int64)


@triton.jit
def _route_kernel(
    ids_ptr,
    log2phy_ptr,
    count_ptr,
    offset_ptr,
    load_ptr,
    valid_ptr,
    record_ptr,
    out_ptr,
    numel,
    top_k,
    num_experts,
    width,
    num_slots,
    load_stride,
    out_max,
    RECORD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = index < numel
    expert = tl.load(ids_ptr + index, mask=inside, other=-1).to(tl.int64)
    row = index // top_k
    offset = tl.load(offset_ptr).to(tl.int64)
    row_hash = _hash_rows(row, offset)
    valid_id = (expert >= 0) & (expert < num_experts)
    safe = tl.where(valid_id, expert, 0)
    count = tl.load(count_ptr + safe, mask=inside, other=1).to(tl.int64)
    count = tl.maximum(count, 1)
    replica = tl.minimum(row_hash % count, width - 1)
    row_start = safe * width
    physical = tl.load(log2phy_ptr + row_start + replica, mask=inside, other=-1).to(tl.int64)
    first = tl.load(log2phy_ptr + row_start, mask=inside, other=-1).to(tl.int64)
    physical = tl.where((physical >= 0) & (physical <= out_max), physical, first)
    keep = valid_id & (physical >= 0) & (physical <= out_max)
    physical = tl.where(keep, physical, -1)
    tl.store(out_ptr + index, physical.to(out_ptr.dtype.element_ty), mask=inside)
    if RECORD:
        counted = inside & (row < _counted_rows(valid_ptr, record_ptr)) & keep
        counted = counted & (physical < num_slots)
        slot = tl.where(counted, physical, 0)
        one = tl.full([BLOCK], 1, load_ptr.dtype.element_ty)
        tl.atomic_add(load_ptr + slot * load_stride, one, mask=counted, sem="relaxed")


@triton.jit
def _record_kernel(
    physical_ptr,
    load_ptr,
    valid_ptr,
    record_ptr,
    numel,
    top_k,
    num_slots,
    load_stride,
    BLOCK: tl.constexpr,
):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = index < numel
    physical = tl.load(physical_ptr + index, mask=inside, other=-1).to(tl.int64)
    row = index // top_k
    counted = inside & (row < _counted_rows(valid_ptr, record_ptr)) & (physical >= 0)
    counted = counted & (physical < num_slots)
    slot = tl.where(counted, physical, 0)
    one = tl.full([BLOCK], 1, load_ptr.dtype.element_ty)
    tl.atomic_add(load_ptr + slot * load_stride, one, mask=counted, sem="relaxed")


def _grid(numel: int) -> tuple[int]:
    return (triton.cdiv(numel, BLOCK),)


def route(
    topk_ids: torch.Tensor,
    log2phy: torch.Tensor,
    replica_count: torch.Tensor,
    offset: torch.Tensor,
    load: torch.Tensor | None,
    num_valid_tokens: torch.Tensor | None,
    record_enabled: torch.Tensor | None,
) -> torch.Tensor:
    """``map_to_physical`` (``load`` None) or ``map_and_record``; arguments already checked.

    ``load`` is written in place (a private, one-cell-per-slot tensor: the checks ensure it), so
    it is never copied (its stride is passed); the other inputs are made contiguous (a no-op
    for the state's rows).
    """
    ids = topk_ids.contiguous()
    table = log2phy.contiguous()
    counts = replica_count.contiguous()
    out = torch.empty_like(ids)
    numel = ids.numel()
    if numel == 0:
        return out
    record = load is not None
    _route_kernel[_grid(numel)](
        ids,
        table,
        counts,
        offset,
        load if record else out,
        num_valid_tokens if record else offset,
        record_enabled if record else offset,
        out,
        numel,
        ids.shape[1],
        table.shape[0],
        table.shape[1],
        load.shape[0] if record else 0,
        load.stride(0) if record else 0,
        torch.iinfo(ids.dtype).max,
        RECORD=record,
        BLOCK=BLOCK,
    )
    return out


def record(
    load: torch.Tensor,
    physical_ids: torch.Tensor,
    num_valid_tokens: torch.Tensor,
    record_enabled: torch.Tensor,
) -> None:
    """``record_load``; arguments already checked."""
    physical = physical_ids.contiguous()
    numel = physical.numel()
    if numel == 0:
        return
    _record_kernel[_grid(numel)](
        physical,
        load,
        num_valid_tokens,
        record_enabled,
        numel,
        physical.shape[1],
        load.shape[0],
        load.stride(0),
        BLOCK=BLOCK,
    )
