"""What every weight view promises the movement plane, and the two errors views raise.

Movement must update the very tensors the active kernel reads (invariant 5). A rebound
``Parameter`` (a new tensor assigned to the module) would leave compiled graphs and captured
device graphs reading the old memory, so a view never replaces a tensor: it only ``copy_``s into
per-slot views of the live storage, and ``data_ptrs()`` stays the same for the process lifetime.
The worker, the scheduler and the sync path rely on nothing about a view but
:class:`ExpertWeightView`, so any format that keeps this promise can be moved.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from eplb_graph.errors import EplbError


class UnsupportedWeightFormat(EplbError, ValueError):
    """A weight format (or the tensors given for it) cannot be moved slot by slot in place.

    Raised while a view is built, before any tensor is touched. ``format_name`` and ``reason``
    are kept as attributes so callers can report them.
    """

    def __init__(self, format_name: object, reason: str) -> None:
        super().__init__(
            f"weight format {format_name!r} cannot be used for expert movement: {reason}"
        )
        self.format_name = format_name
        self.reason = reason


class WeightViewError(EplbError, ValueError):
    """A ``pack_slot``/``unpack_slot_`` call got a bad slot or buffer; nothing was written."""


@runtime_checkable
class ExpertWeightView(Protocol):
    """One MoE layer's expert weights on ONE rank, as the fused kernel reads them.

    Attributes:
        format_name: the registry name of the format (for messages and reports).
        num_slots: local slots on this rank (S, the expert dimension of every tensor).
        slot_nbytes: bytes of one slot's packed payload (all coupled tensors, aligned).
    """

    format_name: str
    num_slots: int
    slot_nbytes: int

    def pack_slot(self, slot: int, out: torch.Tensor) -> None:
        """Copy slot ``slot``'s coupled tensors (ND layout) into ``out`` uint8 ``[slot_nbytes]``."""
        ...

    def unpack_slot_(self, slot: int, src: torch.Tensor) -> None:
        """Write payload ``src`` uint8 ``[slot_nbytes]`` into slot ``slot`` of the live storage."""
        ...

    def data_ptrs(self) -> dict[str, int]:
        """``data_ptr`` of every live tensor by name, for address-stability checks."""
        ...

    def tensors(self) -> dict[str, torch.Tensor]:
        """The live tensors that move (the payload), by name."""
        ...
