"""The payload layout engine: one expert slot packed into one aligned byte payload.

One expert is one transaction. Every tensor the kernel reads for an expert (weights, scales,
fused scales, scale biases, biases) is packed into ONE byte payload (``uint8 [slot_nbytes]``), so
a rank can never install a new weight next to an old scale: block scales that travel apart from
their weights can be lost, and W8A8 scales are meaningless without their int8 weights. Tensors
the kernel does not read (W8A8 offsets with symmetric quantization) are left out of the payload.

Payload layout (computed once per view): the coupled tensors in the order the format lists them,
each in ND (logical, row-major) layout at a byte offset aligned to 16, so a section can be
reinterpreted in place as its dtype without a copy; ``slot_nbytes`` is padded to a multiple of 16
so the rows of a ``[slots, slot_nbytes]`` staging buffer stay aligned. Padding bytes are zero.

:class:`PackedSlotView` knows no format: a format describes each of its tensors as a
:class:`SlotField` (a per-slot view of the live storage, plus an optional layout conversion such
as NZ), and the engine checks the fields, lays the payload out and does every copy.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from eplb_graph.movement.views.contract import UnsupportedWeightFormat, WeightViewError

logger = logging.getLogger(__name__)

#: Byte alignment of every payload section and of ``slot_nbytes`` (the largest dtype is 16 bytes).
PAYLOAD_ALIGN = 16


@dataclass(frozen=True)
class SlotField:
    """One coupled tensor of an expert, as a format exposes it.

    Attributes:
        name: payload section name (``"w13"``, ``"w2_scale"``...).
        live: the whole live tensor the kernel reads (its address must never change).
        slot_view: ``slot -> Tensor``: a VIEW of ``live`` holding that slot (may be strided or in
            an internal layout); writes go through it with ``copy_``.
        payload_shape: ND shape of the slot in the payload; ``None`` = the slot view's shape.
        payload_as_slot: ``payload section [payload_shape] -> view shaped like slot_view`` used to
            convert layouts during the copy (``nd_as_nz`` for NZ); ``None`` = identity.
    """

    name: str
    live: torch.Tensor
    slot_view: Callable[[int], torch.Tensor]
    payload_shape: tuple[int, ...] | None = None
    payload_as_slot: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class PayloadSection:
    """Where one field lives in the packed payload: ``payload[offset : offset + nbytes]``."""

    name: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class PackedSlotView:
    """An :class:`ExpertWeightView` over an ordered list of per-slot fields.

    Args:
        format_name: registry name, used in every message.
        num_slots: S, local slots on this rank.
        fields: the coupled tensors in payload order, each a :class:`SlotField` or a
            ``(name, per_slot_getter)`` pair whose live tensor is ``live[name]``.
        live: live tensors by name for ``(name, getter)`` pairs (optional otherwise).
        unmoved: live tensors of the format that are deliberately NOT in the payload (the kernel
            does not read them); reported by :meth:`unmoved_tensors` and :meth:`data_ptrs`.

    Every getter is called once per slot here to check that each slot is a view of the live
    storage (a getter returning a copy would make writes vanish), that all slots agree in shape,
    dtype and device, and that no two slots share an address (a stride-0 expert dim would make a
    write to one slot change another). Byte offsets are computed once.

    Raises:
        UnsupportedWeightFormat: if the fields cannot satisfy the movement contract.
    """

    def __init__(
        self,
        format_name: str,
        num_slots: int,
        fields: Sequence[SlotField | tuple[str, Callable[[int], torch.Tensor]]],
        live: Mapping[str, torch.Tensor] | None = None,
        unmoved: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.format_name = format_name
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise UnsupportedWeightFormat(
                format_name, f"num_slots must be an int >= 1, got {num_slots!r}"
            )
        self.num_slots = num_slots
        resolved = [self._resolve_field(field, live or {}) for field in fields]
        if not resolved:
            raise UnsupportedWeightFormat(format_name, "no tensors to move")
        names = [field.name for field in resolved]
        if len(set(names)) != len(names):
            raise UnsupportedWeightFormat(format_name, f"duplicate tensor names in {names}")
        self._unmoved = dict(unmoved or {})
        for name in self._unmoved:
            if name in names:
                raise UnsupportedWeightFormat(
                    format_name, f"tensor {name!r} is listed both as moved and as not moved"
                )
        sections = []
        offset = 0
        device = None
        for field in resolved:
            dtype, shape = self._check_field(field)
            if device is None:
                device = field.live.device
            elif field.live.device != device:
                raise UnsupportedWeightFormat(
                    format_name,
                    f"{field.name!r} is on {field.live.device} but {resolved[0].name!r} is on "
                    f"{device}: an expert's coupled tensors must move in one transaction",
                )
            nbytes = dtype.itemsize * math.prod(shape)
            sections.append(PayloadSection(field.name, offset, nbytes, dtype, shape))
            offset = _round_up(offset + nbytes, PAYLOAD_ALIGN)
        self._fields = tuple(resolved)
        self.sections: tuple[PayloadSection, ...] = tuple(sections)
        self.slot_nbytes = offset
        self._padding = _padding_ranges(self.sections, self.slot_nbytes)
        logger.debug(
            "%s view: %d slots, %d payload bytes per slot (%s)",
            format_name,
            num_slots,
            self.slot_nbytes,
            ", ".join(f"{s.name}@{s.offset}+{s.nbytes}" for s in self.sections),
        )

    # -- construction checks -----------------------------------------------------------------
    def _resolve_field(
        self,
        field: SlotField | tuple[str, Callable[[int], torch.Tensor]],
        live: Mapping[str, torch.Tensor],
    ) -> SlotField:
        if isinstance(field, SlotField):
            return field
        try:
            name, getter = field
        except (TypeError, ValueError):
            raise UnsupportedWeightFormat(
                self.format_name, f"a field must be a SlotField or (name, getter), got {field!r}"
            ) from None
        if name not in live:
            raise UnsupportedWeightFormat(
                self.format_name, f"field {name!r} has a getter but no live tensor in 'live'"
            )
        return SlotField(name, live[name], getter)

    def _check_field(self, field: SlotField) -> tuple[torch.dtype, tuple[int, ...]]:
        fmt, name = self.format_name, field.name
        if not isinstance(field.live, torch.Tensor):
            raise UnsupportedWeightFormat(fmt, f"{name!r} is not a tensor: {type(field.live)}")
        if field.live.device.type == "meta":
            raise UnsupportedWeightFormat(fmt, f"{name!r} is a meta tensor and holds no data")
        storage = field.live.untyped_storage().data_ptr()
        first = None
        seen: dict[int, int] = {}
        for slot in range(self.num_slots):
            try:
                view = field.slot_view(slot)
            except (IndexError, RuntimeError, ValueError) as error:
                raise UnsupportedWeightFormat(
                    fmt, f"{name!r}: slot {slot} cannot be viewed: {error}"
                ) from error
            if not isinstance(view, torch.Tensor):
                raise UnsupportedWeightFormat(fmt, f"{name!r}: slot {slot} is not a tensor")
            if view.untyped_storage().data_ptr() != storage:
                raise UnsupportedWeightFormat(
                    fmt,
                    f"{name!r}: slot {slot} is not a view of the live tensor's storage (a copy "
                    "would make writes invisible to the kernel)",
                )
            if first is None:
                first = view
            elif view.shape != first.shape or view.dtype != first.dtype:
                raise UnsupportedWeightFormat(
                    fmt,
                    f"{name!r}: slot {slot} has shape {tuple(view.shape)} {view.dtype}, slot 0 "
                    f"has {tuple(first.shape)} {first.dtype}",
                )
            if view.numel() and view.data_ptr() in seen:
                raise UnsupportedWeightFormat(
                    fmt,
                    f"{name!r}: slots {seen[view.data_ptr()]} and {slot} share memory (stride-0 "
                    "expert dimension?); writing one slot would change the other",
                )
            seen[view.data_ptr()] = slot
        assert first is not None
        if first.numel() == 0:
            raise UnsupportedWeightFormat(fmt, f"{name!r}: a slot holds no elements")
        if field.payload_as_slot is None:
            shape = tuple(first.shape)
        else:
            shape = tuple(field.payload_shape or ())
            probe = torch.empty(shape, dtype=first.dtype, device="meta")
            try:
                converted = field.payload_as_slot(probe)
            except (RuntimeError, ValueError) as error:
                raise UnsupportedWeightFormat(
                    fmt, f"{name!r}: payload shape {shape} cannot be converted: {error}"
                ) from error
            if tuple(converted.shape) != tuple(first.shape):
                raise UnsupportedWeightFormat(
                    fmt,
                    f"{name!r}: payload {shape} converts to {tuple(converted.shape)}, but a slot "
                    f"is {tuple(first.shape)}",
                )
        return first.dtype, shape

    # -- ExpertWeightView ----------------------------------------------------------------------
    def pack_slot(self, slot: int, out: torch.Tensor) -> None:
        """Copy slot ``slot``'s coupled tensors into ``out`` uint8 ``[slot_nbytes]`` (ND layout).

        ``out`` may be pinned host memory or a row of a staging matrix; it must be contiguous and
        start 16-byte aligned within its storage. The live storage is only read.
        """
        self._check_call(slot, out, "out")
        with torch.no_grad():
            for section, field in zip(self.sections, self._fields, strict=True):
                self._payload_as_slot(section, field, out).copy_(field.slot_view(slot))
            for start, stop in self._padding:
                out[start:stop].zero_()

    def unpack_slot_(self, slot: int, src: torch.Tensor) -> None:
        """Write payload ``src`` uint8 ``[slot_nbytes]`` into slot ``slot`` IN PLACE.

        Every section is ``copy_``'d into the slot view of the original storage (converting an
        internal layout on the way); no tensor is ever rebound, so ``data_ptrs()`` is unchanged.
        The call is validated before any byte is written.
        """
        self._check_call(slot, src, "src")
        with torch.no_grad():
            for section, field in zip(self.sections, self._fields, strict=True):
                field.slot_view(slot).copy_(self._payload_as_slot(section, field, src))

    def data_ptrs(self) -> dict[str, int]:
        """``data_ptr`` of every live tensor (moved and unmoved) by name."""
        return {name: tensor.data_ptr() for name, tensor in self._all_tensors().items()}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The live tensors whose slots are in the payload (what movement writes), by name."""
        return {field.name: field.live for field in self._fields}

    # -- additions -------------------------------------------------------------------------------
    def unmoved_tensors(self) -> dict[str, torch.Tensor]:
        """Live tensors of the format that movement never reads or writes (e.g. W8A8 offsets)."""
        return dict(self._unmoved)

    @property
    def payload_names(self) -> tuple[str, ...]:
        """Names of the payload sections, in payload order."""
        return tuple(section.name for section in self.sections)

    def slot_tensor(self, name: str, slot: int) -> torch.Tensor:
        """The live view of one field at one slot (for tests and diagnostics)."""
        for field in self._fields:
            if field.name == name:
                self._check_slot(slot)
                return field.slot_view(slot)
        raise KeyError(f"{self.format_name}: no moved tensor named {name!r}")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(format={self.format_name!r}, slots={self.num_slots}, "
            f"slot_nbytes={self.slot_nbytes}, payload={list(self.payload_names)})"
        )

    # -- internals -------------------------------------------------------------------------------
    def _all_tensors(self) -> dict[str, torch.Tensor]:
        return {**self.tensors(), **self._unmoved}

    @staticmethod
    def _payload_as_slot(
        section: PayloadSection, field: SlotField, buffer: torch.Tensor
    ) -> torch.Tensor:
        payload = buffer[section.offset : section.offset + section.nbytes]
        payload = payload.view(section.dtype).view(section.shape)
        if field.payload_as_slot is not None:
            payload = field.payload_as_slot(payload)
        return payload

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise WeightViewError(f"{self.format_name}: slot must be an int, got {slot!r}")
        if not 0 <= slot < self.num_slots:
            raise WeightViewError(
                f"{self.format_name}: slot {slot} is out of range [0, {self.num_slots})"
            )

    def _check_call(self, slot: int, buffer: torch.Tensor, what: str) -> None:
        self._check_slot(slot)
        if not isinstance(buffer, torch.Tensor):
            raise WeightViewError(
                f"{self.format_name}: {what} must be a tensor, got {type(buffer)}"
            )
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != self.slot_nbytes:
            raise WeightViewError(
                f"{self.format_name}: {what} must be uint8 [{self.slot_nbytes}], got "
                f"{buffer.dtype} {list(buffer.shape)}"
            )
        if not buffer.is_contiguous():
            raise WeightViewError(f"{self.format_name}: {what} must be contiguous")
        if buffer.storage_offset() % PAYLOAD_ALIGN:
            raise WeightViewError(
                f"{self.format_name}: {what} starts at byte {buffer.storage_offset()} of its "
                f"storage; payload buffers must be {PAYLOAD_ALIGN}-byte aligned"
            )


def _padding_ranges(sections: Sequence[PayloadSection], total: int) -> tuple[tuple[int, int], ...]:
    gaps = []
    cursor = 0
    for section in sections:
        if section.offset > cursor:
            gaps.append((cursor, section.offset))
        cursor = section.offset + section.nbytes
    if total > cursor:
        gaps.append((cursor, total))
    return tuple(gaps)
