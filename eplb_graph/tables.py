"""The rules of a placement table and the tables derived from it.

A placement of ``L`` MoE layers is a ``phy2log [L, P]`` table: the logical expert in every
physical slot. This module says what makes such a table valid (and names the first defect when
it is not), and derives what the routing op reads from it: replica counts ``[L, N]`` and the
``log2phy [L, N, R]`` lookup. It depends on nothing else in the package, so the placement value
object, the expert-map file format, the device state and the policies can all share one
definition of "valid" without depending on each other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eplb_graph.arguments import as_index
from eplb_graph.errors import EplbError


class PlacementError(EplbError, ValueError):
    """A placement (or a request to build one) is malformed; raised before anything is written."""


def as_phy2log(phy2log: torch.Tensor | Sequence) -> torch.Tensor:
    if not isinstance(phy2log, torch.Tensor):
        try:
            phy2log = torch.as_tensor(phy2log)
        except (TypeError, ValueError, RuntimeError) as error:
            raise PlacementError(f"phy2log is not a rectangular integer array: {error}") from error
    if phy2log.dtype.is_floating_point or phy2log.dtype.is_complex or phy2log.dtype == torch.bool:
        raise PlacementError(f"phy2log must hold integer expert ids, got dtype {phy2log.dtype}")
    if phy2log.dim() != 2:
        raise PlacementError(
            f"phy2log must be 2-D [num_layers, num_slots], got shape {tuple(phy2log.shape)}"
        )
    return phy2log.detach().to(device="cpu", dtype=torch.int64).contiguous()


def validate_layer_row(
    phy2log_row: torch.Tensor | Sequence,
    layer: int,
    num_logical: int,
    num_ranks: int,
    num_slots: int,
) -> torch.Tensor:
    """One layer's new ``phy2log`` row, validated; returns it as ``[P]`` int64 on the CPU.

    The one row validator: :meth:`Placement.with_layer` and ``EplbState.prepare_layer`` both use
    it, so a row is judged by the same rules, and every :class:`PlacementError` names ``layer``
    (not the position of the row in a one-layer table). Only a 1-D ``[P]`` input is accepted
    (never flattened).
    """
    try:
        row = torch.as_tensor(phy2log_row)
    except (TypeError, ValueError, RuntimeError) as error:
        raise PlacementError(
            f"layer {layer}: phy2log row is not an integer array: {error}"
        ) from error
    if row.dim() != 1:
        raise PlacementError(
            f"layer {layer}: phy2log row must be 1-D [P], got shape {tuple(row.shape)}"
        )
    table = as_phy2log(row.unsqueeze(0))
    if table.shape[1] != num_slots:
        raise PlacementError(
            f"layer {layer}: phy2log row has {table.shape[1]} slots, expected {num_slots}"
        )
    validate_phy2log(table, num_logical, num_ranks, first_layer=layer)
    return table[0]


def replica_counts(phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """Replicas of each expert per layer: ``phy2log [L, P]`` -> ``[L, N]`` int64, vectorized."""
    counts = torch.zeros(phy2log.shape[0], num_logical, dtype=torch.int64)
    return counts.scatter_add_(1, phy2log, torch.ones_like(phy2log))


def derive_log2phy(phy2log: torch.Tensor, num_logical: int, max_replicas: int) -> torch.Tensor:
    """``phy2log [L, P]`` -> ``log2phy [L, N, R]``: each expert's slots ascending, -1 padded.

    Vectorized: a stable sort groups the slots of each expert in ascending slot order; a slot's
    replica index is its position minus the first position of its expert's group.
    """
    num_layers, num_slots = phy2log.shape
    order = torch.sort(phy2log, dim=1, stable=True)
    sorted_experts, sorted_slots = order.values, order.indices
    counts = replica_counts(phy2log, num_logical)
    group_start = torch.cumsum(counts, dim=1) - counts  # [L, N] first sorted position of e
    position = torch.arange(num_slots).expand(num_layers, num_slots)
    replica = position - group_start.gather(1, sorted_experts)
    log2phy = torch.full((num_layers, num_logical * max_replicas), -1, dtype=torch.int64)
    log2phy.scatter_(1, sorted_experts * max_replicas + replica, sorted_slots)
    return log2phy.view(num_layers, num_logical, max_replicas)


def check_slots_per_rank(
    num_slots: int,
    num_ranks: int,
    *,
    name: str = "num_slots",
    error: type[Exception] = PlacementError,
) -> int:
    """``P / num_ranks``, after checking that every EP rank can hold the same number of slots.

    Args:
        num_slots: ``P``, the physical slots of a layer.
        num_ranks: EP ranks.
        name: what the caller calls ``P`` (named in the message).
        error: the exception type to raise; a module with its own input-error type passes it.

    Raises:
        PlacementError (or ``error``): ``num_ranks < 1`` or ``P % num_ranks != 0``.
    """
    if num_ranks < 1:
        raise error(f"num_ranks must be >= 1, got {num_ranks}")
    if num_slots % num_ranks != 0:
        raise error(
            f"{name} P={num_slots} is not divisible by num_ranks={num_ranks}: the slots cannot "
            "be split evenly over the ranks (P = num_logical + num_redundant_experts must be a "
            "multiple of the EP size)"
        )
    return num_slots // num_ranks


def validate_phy2log(
    phy2log: torch.Tensor, num_logical: int, num_ranks: int, *, first_layer: int = 0
) -> None:
    """Raise :class:`PlacementError` naming the first defect of ``phy2log [L, P]``.

    ``first_layer`` is the model layer of row 0, for messages about a slice of a placement.
    """
    if num_logical < 1:
        raise PlacementError(f"num_logical must be >= 1, got {num_logical}")
    if num_ranks < 1:
        raise PlacementError(f"num_ranks must be >= 1, got {num_ranks}")
    num_layers, num_slots = phy2log.shape
    if num_layers < 1 or num_slots < 1:
        raise PlacementError(
            f"phy2log must have at least one layer and one slot, got {(num_layers, num_slots)}"
        )
    check_slots_per_rank(num_slots, num_ranks)
    if num_slots < num_logical:
        raise PlacementError(
            f"num_slots P={num_slots} is smaller than num_logical N={num_logical}: "
            "every logical expert needs at least one slot"
        )
    out_of_range = (phy2log < 0) | (phy2log >= num_logical)
    if bool(out_of_range.any()):
        layer, slot = (int(i) for i in out_of_range.nonzero()[0])
        raise PlacementError(
            f"layer {first_layer + layer}, slot {slot}: expert id {int(phy2log[layer, slot])} "
            f"is out of range [0, {num_logical})"
        )
    missing = replica_counts(phy2log, num_logical) == 0
    if bool(missing.any()):
        layer, expert = (int(i) for i in missing.nonzero()[0])
        raise PlacementError(f"layer {first_layer + layer}: logical expert {expert} has no slot")


def check_lookup_width(replica_count: torch.Tensor, max_replicas: int, *, first_layer: int = 0):
    """Raise :class:`PlacementError` unless every expert's replicas fit a lookup of width
    ``max_replicas`` (``replica_count [L, N]``; ``first_layer`` names row 0 in messages)."""
    if max_replicas < 1:
        raise PlacementError(f"max_replicas must be >= 1, got {max_replicas}")
    most = int(replica_count.max())
    if most > max_replicas:
        layer, expert = divmod(int(replica_count.argmax()), replica_count.shape[1])
        raise PlacementError(
            f"layer {first_layer + layer}: expert {expert} has {most} replicas but the lookup "
            f"width R={max_replicas} (max_replicas chosen at start-up) holds at most "
            f"{max_replicas}"
        )


def check_layer_index(layer: object, num_layers: int) -> int:
    """A layer index as a plain int in ``[0, num_layers)``.

    Integers of any kind (Python, numpy, a 0-d integer tensor) are accepted; booleans and
    negatives are refused, because ``True`` would silently mean layer 1 and ``-1`` the last one.
    """
    return as_index("layer", layer, num_layers, error=PlacementError)
