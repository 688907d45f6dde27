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
        log2phy: ``[N, R]`` int32/int64, row e lists e's slots in ascending order, -1 padded.
        replica_count: ``[N]`` int32/int64 number of valid entries of each row.
        offset: 0-d int64; row t hashes ``(t + offset) * 2654435769 mod 2**32`` and takes
            replica ``h % max(count, 1)``; all K choices of a row share the hash.

    Returns:
        ``[T, K]`` physical slot ids with ``topk_ids``' dtype.
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
        load: ``[P]`` int32/int64 per-slot counter, mutated.
        physical_ids: ``[T, K]`` slots; ids outside ``[0, P)`` are not counted.
        num_valid_tokens: 0-d integer; rows at or beyond it are padding and not counted.
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

    Shapes as in :func:`map_to_physical` and :func:`record_load`; returns ``[T, K]`` slots.
    """
    return _OPS.map_and_record.default(
        topk_ids, log2phy, replica_count, offset, load, num_valid_tokens, record_enabled
    )
