"""Typed entry points for the routing ops. Each is a thin call into ``torch.ops.eplb_graph``.

These are what model code calls; torch.compile sees the underlying op (one node, no graph break)
and captured device graphs replay its kernel. Every argument is a tensor, so changing a value
(offset, valid-token count, record flag) never recompiles or re-captures.
"""

from __future__ import annotations

import torch

import eplb_graph.ops.registration  # noqa: F401  (defines the schemas before any call)

_OPS = torch.ops.eplb_graph


def map_to_physical(
    topk_ids: torch.Tensor,
    log2phy: torch.Tensor,
    replica_count: torch.Tensor,
    offset: torch.Tensor,
) -> torch.Tensor:
    """Map logical expert ids to physical slots.

    Args:
        topk_ids: ``[T, K]`` int32/int64 logical ids; ids outside ``[0, N)`` map to -1.
        log2phy: ``[N, R]`` int32/int64 (N, R >= 1), row e lists e's slots in ascending order,
            -1 padded.
        replica_count: ``[N]`` int32/int64 number of valid entries of each row.
        offset: 0-d int64, any value; row t hashes ``(t + offset) * 2654435769 mod 2**32`` and
            takes replica ``min(h % max(count, 1), R - 1)``; all K choices of a row share the hash.

    Returns:
        ``[T, K]`` physical slot ids with ``topk_ids``' dtype.

    Table values are not checked (that would read device data), so every value has one defined
    result, the same on every kernel: a chosen entry that is negative, or larger than
    ``topk_ids``' dtype holds, falls back to the row's replica 0 (a torn refresh), and to -1 if
    that is no usable slot either; an entry ``>= P`` is returned as is (and never counted).
    Shapes, dtypes and devices are checked; a bad one raises ``RuntimeError`` naming the argument.
    """
    return _OPS.map_to_physical.default(topk_ids, log2phy, replica_count, offset)


def record_load(
    load: torch.Tensor,
    physical_ids: torch.Tensor,
    num_valid_tokens: torch.Tensor,
    record_enabled: torch.Tensor,
) -> None:
    """Count executed (token, slot) pairs into ``load`` in place.

    Args:
        load: ``[P]`` int32/int64 per-slot counter, mutated; P >= 1, one memory cell per slot
            (no stride-0 view) and no memory shared with another argument, else
            ``RuntimeError``. Counters wrap at their dtype's limit.
        physical_ids: ``[T, K]`` slots; ids outside ``[0, P)`` are not counted.
        num_valid_tokens: 0-d integer, any value; rows at or beyond it are padding and not
            counted (a negative value counts nothing, one above T counts every row).
        record_enabled: 0-d bool; when False nothing is counted (the kernel still runs).
    """
    _OPS.record_load.default(load, physical_ids, num_valid_tokens, record_enabled)


def map_and_record(
    topk_ids: torch.Tensor,
    log2phy: torch.Tensor,
    replica_count: torch.Tensor,
    offset: torch.Tensor,
    load: torch.Tensor,
    num_valid_tokens: torch.Tensor,
    record_enabled: torch.Tensor,
) -> torch.Tensor:
    """``map_to_physical`` then ``record_load`` of its output, as one op (one pass natively).

    Shapes and rules as in :func:`map_to_physical` and :func:`record_load`; every argument is
    checked before anything is written. Returns ``[T, K]`` slots.
    """
    return _OPS.map_and_record.default(
        topk_ids, log2phy, replica_count, offset, load, num_valid_tokens, record_enabled
    )
