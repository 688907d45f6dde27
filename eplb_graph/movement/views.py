"""Weight views: the exact storage a fused MoE kernel reads, one expert slot at a time.

Invariant 5: weight movement must update the very tensors the active kernel reads. A rebound
``Parameter`` (a new tensor assigned to the module) would leave compiled graphs and captured
device graphs reading the old memory, so a view never replaces a tensor: it only ``copy_``s into
per-slot views of the live storage, and ``data_ptrs()`` stays the same for the process lifetime.

One expert is one transaction. Every tensor the kernel reads for an expert (weights, scales,
fused scales, scale biases, biases) is packed into ONE byte payload (``uint8 [slot_nbytes]``), so
a rank can never install a new weight next to an old scale (upstream lost nvfp4 block scales from
its migration once, and W8A8 scales must travel with their int8 weights). Tensors the kernel does
not read (W8A8 offsets with symmetric quantization) are deliberately left out of the payload.

Payload layout (computed once per view): the coupled tensors in the order the format lists them,
each in ND (logical, row-major) layout at a byte offset aligned to 16, so a section can be
reinterpreted in place as its dtype without a copy; ``slot_nbytes`` is padded to a multiple of 16
so the rows of a ``[slots, slot_nbytes]`` staging buffer stay aligned. Padding bytes are zero.

Internal layouts (Ascend fractal NZ) cannot be sent as a view of their storage: the per-expert
block lives inside a blocked tensor (vllm-ascend hung sending whole NZ tensors, and NZ slice
copies can touch neighbouring experts). The payload is therefore always ND: packing converts the
slot's NZ block into the ND payload (``to_nd``), unpacking converts ND back (``from_nd``) and
``copy_``s into the original NZ storage.

Formats that cannot satisfy this contract are rejected by name when the view is built
(:class:`UnsupportedWeightFormat`), never at the first rearrangement.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, runtime_checkable

import torch

from eplb_graph.errors import EplbError

logger = logging.getLogger(__name__)

#: Byte alignment of every payload section and of ``slot_nbytes`` (the largest dtype is 16 bytes).
PAYLOAD_ALIGN = 16


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


# -- fractal NZ <-> ND ----------------------------------------------------------------------------


def to_nd(nz: torch.Tensor) -> torch.Tensor:
    """Fractal NZ ``[..., F1, H1, h0, f0]`` -> a new contiguous ND ``[..., H1*h0, F1*f0]``.

    Models Ascend ``FRACTAL_NZ``: an ND matrix ``[H, F]`` is cut into ``h0 x f0`` blocks stored
    column-block-major (``nz[fb, hb, i, j] = nd[hb*h0 + i, fb*f0 + j]``).
    """
    if nz.dim() < 4:
        raise ValueError(
            f"an NZ tensor needs >= 4 dims [..., F1, H1, h0, f0], got {tuple(nz.shape)}"
        )
    nd = nz.new_empty(nz_to_nd_shape(nz.shape))
    nd_as_nz(nd, nz.shape[-2], nz.shape[-1]).copy_(nz)
    return nd


def from_nd(nd: torch.Tensor, h0: int = 16, f0: int = 16) -> torch.Tensor:
    """ND ``[..., H, F]`` -> a new contiguous fractal NZ ``[..., F/f0, H/h0, h0, f0]``."""
    return nd_as_nz(nd, h0, f0).contiguous()


def nd_as_nz(nd: torch.Tensor, h0: int, f0: int) -> torch.Tensor:
    """A strided VIEW of ND ``[..., H, F]`` shaped like its NZ form ``[..., F/f0, H/h0, h0, f0]``.

    ``copy_`` between this view and an NZ block converts layouts in one pass without a temporary:
    that is how a slot's NZ block is packed into (and unpacked from) its ND payload.
    """
    if nd.dim() < 2:
        raise ValueError(f"an ND matrix needs >= 2 dims [..., H, F], got {tuple(nd.shape)}")
    rows, cols = nd.shape[-2], nd.shape[-1]
    if h0 < 1 or f0 < 1 or rows % h0 or cols % f0:
        raise ValueError(f"ND matrix [{rows}, {cols}] does not tile into {h0}x{f0} fractal blocks")
    batch = nd.shape[:-2]
    blocked = nd.reshape(*batch, rows // h0, h0, cols // f0, f0)  # [..., H1, h0, F1, f0]
    n = len(batch)
    return blocked.permute(*range(n), n + 2, n, n + 1, n + 3)  # [..., F1, H1, h0, f0]


def nz_to_nd_shape(nz_shape: Sequence[int]) -> tuple[int, ...]:
    """``[..., F1, H1, h0, f0]`` -> ``[..., H1*h0, F1*f0]``."""
    *batch, f1, h1, h0, f0 = nz_shape
    return (*batch, h1 * h0, f1 * f0)


# -- the generic packed view ----------------------------------------------------------------------


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
            nbytes = dtype.itemsize * _numel(shape)
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


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


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


# -- format helpers -------------------------------------------------------------------------------

_LAYOUTS = ("nd", "nz")


class _Checker:
    """Shape/dtype checks shared by the format classes; every failure names the format."""

    def __init__(self, format_name: str, layout: str = "nd") -> None:
        self.format_name = format_name
        if layout not in _LAYOUTS:
            self.fail(f"weight_layout must be one of {_LAYOUTS}, got {layout!r}")
        self.layout = layout
        self.num_slots: int | None = None
        self.first_name: str | None = None
        self.device: torch.device | None = None

    def fail(self, reason: str) -> NoReturn:
        raise UnsupportedWeightFormat(self.format_name, reason)

    def tensor(
        self,
        name: str,
        tensor: Any,
        dims: int,
        dtypes: Iterable[torch.dtype] | None = None,
        *,
        floating: bool = False,
        nz: bool = False,
    ) -> tuple[int, ...]:
        """Check ``tensor`` and return its logical (ND) shape ``[S, ...]``."""
        if not isinstance(tensor, torch.Tensor):
            self.fail(f"{name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        if nz:
            if tensor.dim() != dims + 2:
                self.fail(
                    f"{name!r} in fractal NZ layout must be {dims + 2}-D [S, F1, H1, h0, f0], "
                    f"got shape {tuple(tensor.shape)}"
                )
            shape = nz_to_nd_shape(tensor.shape)
        else:
            if tensor.dim() != dims:
                self.fail(
                    f"{name!r} must be {dims}-D with the expert dimension first, got shape "
                    f"{tuple(tensor.shape)} (missing expert dimension?)"
                )
            shape = tuple(tensor.shape)
        if dtypes is not None:
            allowed = tuple(dtypes)
            if tensor.dtype not in allowed:
                self.fail(
                    f"{name!r} must have dtype {' or '.join(map(str, allowed))}, got {tensor.dtype}"
                )
        if floating and not tensor.dtype.is_floating_point:
            self.fail(f"{name!r} must be a floating-point tensor, got {tensor.dtype}")
        if self.num_slots is None:
            self.num_slots, self.first_name, self.device = shape[0], name, tensor.device
        elif shape[0] != self.num_slots:
            self.fail(
                f"{name!r} has {shape[0]} experts in its leading dimension but "
                f"{self.first_name!r} has {self.num_slots}: every tensor must be [S, ...]"
            )
        if tensor.device != self.device:
            self.fail(f"{name!r} is on {tensor.device} but {self.first_name!r} is on {self.device}")
        if shape[0] > 1 and tensor.stride(0) == 0:
            self.fail(f"{name!r} has a stride-0 expert dimension (an expanded tensor): slots alias")
        return shape

    def same_dtype(self, *pairs: tuple[str, torch.Tensor]) -> None:
        (first_name, first), *rest = pairs
        for name, tensor in rest:
            if tensor.dtype != first.dtype:
                self.fail(f"{name!r} is {tensor.dtype} but {first_name!r} is {first.dtype}")

    def equal(self, what: str, got: int, expected: int) -> None:
        if got != expected:
            self.fail(f"{what}: got {got}, expected {expected}")


def _leading_field(name: str, tensor: torch.Tensor, nz: bool = False) -> SlotField:
    """A field whose expert dimension is dim 0 (``tensor[slot]``), optionally in NZ layout."""
    if not nz:
        return SlotField(name, tensor, tensor.__getitem__)
    h0, f0 = tensor.shape[-2], tensor.shape[-1]
    return SlotField(
        name,
        tensor,
        tensor.__getitem__,
        payload_shape=nz_to_nd_shape(tensor.shape[1:]),
        payload_as_slot=lambda payload: nd_as_nz(payload, h0, f0),
    )


def _check_mlp(
    check: _Checker,
    w13: tuple[int, ...],
    w2: tuple[int, ...],
    pack: int = 1,
) -> None:
    """``w13 [S, 2I, H/pack]`` and ``w2 [S, H, I/pack]`` (``pack`` values per stored element)."""
    check.equal("hidden size: w13.shape[2] * pack vs w2.shape[1]", w13[2] * pack, w2[1])
    check.equal("gate+up rows: w13.shape[1] vs 2 * w2.shape[2] * pack", w13[1], 2 * w2[2] * pack)


# -- formats ---------------------------------------------------------------------------


class UnquantizedView(PackedSlotView):
    """Float experts: ``w13 [S, 2I, H]``, ``w2 [S, H, I]``, optional ``w13_bias [S, 2I]`` and
    ``w2_bias [S, H]``; any floating dtype (all tensors the same).

    ``weight_layout="nz"``: ``w13``/``w2`` are stored in fractal NZ
    (``[S, H/f0, 2I/h0, h0, f0]`` and ``[S, I/f0, H/h0, h0, f0]``); shapes above are their ND form.
    """

    FORMAT = "unquantized"

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        *,
        weight_layout: str = "nd",
    ) -> None:
        fmt = self.FORMAT if weight_layout == "nd" else f"{self.FORMAT}_{weight_layout}"
        check = _Checker(fmt, weight_layout)
        nz = weight_layout == "nz"
        w13_shape = check.tensor("w13", w13, 3, floating=True, nz=nz)
        w2_shape = check.tensor("w2", w2, 3, floating=True, nz=nz)
        check.same_dtype(("w13", w13), ("w2", w2))
        _check_mlp(check, w13_shape, w2_shape)
        fields = [_leading_field("w13", w13, nz), _leading_field("w2", w2, nz)]
        for name, bias, width in (
            ("w13_bias", w13_bias, w13_shape[1]),
            ("w2_bias", w2_bias, w2_shape[1]),
        ):
            if bias is None:
                continue
            shape = check.tensor(name, bias, 2)
            check.same_dtype(("w13", w13), (name, bias))
            check.equal(f"{name}.shape[1]", shape[1], width)
            fields.append(_leading_field(name, bias))
        super().__init__(fmt, w13_shape[0], fields)


class W8A8View(PackedSlotView):
    """Int8 experts with per-channel scales, moved as one payload per expert.

    Moved: ``w13`` int8 ``[S, 2I, H]``, ``w2`` int8 ``[S, H, I]``, ``w13_scale`` fp32 ``[S, 2I]``,
    ``w2_scale`` fp32 ``[S, H]``, ``w13_fused_scale`` int64 ``[S, 2I]`` and ``w2_fused_scale``
    int64 ``[S, H]`` (the fp32 scales packed into int64 for fused MC2 kernels).

    NOT moved: ``w13_offset``/``w2_offset``. With symmetric quantization the kernel never reads
    them, so moving them would only cost bytes (vllm-ascend makes the same choice); they are kept
    as :meth:`unmoved_tensors` so their addresses are still checked, and after a rearrangement
    they describe the slot's previous expert. Do not use this view for asymmetric kernels.

    ``weight_layout="nz"``: the int8 weights are stored in fractal NZ (see
    :class:`UnquantizedView`); scales stay ND.
    """

    FORMAT = "w8a8"
    _PACK = 1  # values per stored int8

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor,
        w2_scale: torch.Tensor,
        w13_fused_scale: torch.Tensor,
        w2_fused_scale: torch.Tensor,
        w13_offset: torch.Tensor | None = None,
        w2_offset: torch.Tensor | None = None,
        *,
        weight_layout: str = "nd",
    ) -> None:
        self._build(
            weight_layout,
            dict(
                w13=w13,
                w2=w2,
                w13_scale=w13_scale,
                w2_scale=w2_scale,
                w13_fused_scale=w13_fused_scale,
                w2_fused_scale=w2_fused_scale,
            ),
            dict(w13_offset=w13_offset, w2_offset=w2_offset),
        )

    def _build(
        self,
        weight_layout: str,
        moved: dict[str, torch.Tensor],
        offsets: dict[str, torch.Tensor | None],
    ) -> None:
        fmt = self.FORMAT if weight_layout == "nd" else f"{self.FORMAT}_{weight_layout}"
        check = _Checker(fmt, weight_layout)
        nz = weight_layout == "nz"
        w13 = check.tensor("w13", moved["w13"], 3, (torch.int8,), nz=nz)
        w2 = check.tensor("w2", moved["w2"], 3, (torch.int8,), nz=nz)
        _check_mlp(check, w13, w2, self._PACK)
        widths = {"w13": w13[1], "w2": w2[1]}
        fields = [_leading_field("w13", moved["w13"], nz), _leading_field("w2", moved["w2"], nz)]
        for name, tensor in moved.items():
            if name in widths:
                continue
            owner = name.split("_", 1)[0]
            dtype = torch.int64 if name.endswith("fused_scale") else torch.float32
            shape = check.tensor(name, tensor, 2, (dtype,))
            check.equal(f"{name}.shape[1] (output channels of {owner})", shape[1], widths[owner])
            fields.append(_leading_field(name, tensor))
        unmoved = {}
        for name, tensor in offsets.items():
            if tensor is None:
                continue
            shape = check.tensor(name, tensor, 2)
            owner = name.split("_", 1)[0]
            check.equal(f"{name}.shape[1] (output channels of {owner})", shape[1], widths[owner])
            unmoved[name] = tensor
        super().__init__(fmt, w13[0], fields, unmoved=unmoved)


class W4A8View(W8A8View):
    """W8A8 plus fp32 ``w13_scale_bias [S, 2I]`` and ``w2_scale_bias [S, H]``.

    Int4 weights are stored two per int8: ``w13`` int8 ``[S, 2I, H/2]``, ``w2`` int8
    ``[S, H, I/2]``. The scale biases are read by the kernel, so they travel in the payload;
    offsets do not (see :class:`W8A8View`).
    """

    FORMAT = "w4a8"
    _PACK = 2

    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor,
        w2_scale: torch.Tensor,
        w13_fused_scale: torch.Tensor,
        w2_fused_scale: torch.Tensor,
        w13_scale_bias: torch.Tensor,
        w2_scale_bias: torch.Tensor,
        w13_offset: torch.Tensor | None = None,
        w2_offset: torch.Tensor | None = None,
        *,
        weight_layout: str = "nd",
    ) -> None:
        self._build(
            weight_layout,
            dict(
                w13=w13,
                w2=w2,
                w13_scale=w13_scale,
                w2_scale=w2_scale,
                w13_fused_scale=w13_fused_scale,
                w2_fused_scale=w2_fused_scale,
                w13_scale_bias=w13_scale_bias,
                w2_scale_bias=w2_scale_bias,
            ),
            dict(w13_offset=w13_offset, w2_offset=w2_offset),
        )


class StridedPackedView(PackedSlotView):
    """Experts packed inside larger tensors along a non-leading dimension.

    Example: a weight stored ``[H, S, F]`` so expert slot ``e`` is ``t[:, e, :]``, a strided,
    non-contiguous view. Packing copies the strided slot into the contiguous payload; unpacking
    ``copy_``s back into the strided view, so the original storage is written in place.

    Args:
        tensors: live tensors by name, in payload order.
        expert_dim: the expert dimension, one int for all tensors or a mapping name -> dim.
        format_name: reported name (default ``"strided_packed"``).
    """

    FORMAT = "strided_packed"

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        expert_dim: int | Mapping[str, int] = 1,
        *,
        format_name: str = FORMAT,
    ) -> None:
        if not isinstance(tensors, Mapping) or not tensors:
            raise UnsupportedWeightFormat(
                format_name, "tensors must be a non-empty name -> tensor map"
            )
        fields = []
        num_slots = None
        for name, tensor in tensors.items():
            dim = expert_dim.get(name) if isinstance(expert_dim, Mapping) else expert_dim
            if not isinstance(tensor, torch.Tensor):
                raise UnsupportedWeightFormat(format_name, f"{name!r} is not a tensor")
            if (
                isinstance(dim, bool)
                or not isinstance(dim, int)
                or not -tensor.dim() <= dim < tensor.dim()
            ):
                raise UnsupportedWeightFormat(
                    format_name,
                    f"{name!r} of shape {tuple(tensor.shape)} has no expert dimension {dim!r}",
                )
            dim %= tensor.dim()
            size = tensor.shape[dim]
            if num_slots is None:
                num_slots = size
            elif size != num_slots:
                raise UnsupportedWeightFormat(
                    format_name,
                    f"{name!r} has {size} experts along dim {dim}, other tensors have {num_slots}",
                )
            fields.append(SlotField(name, tensor, _selector(tensor, dim)))
        assert num_slots is not None
        super().__init__(format_name, num_slots, fields)


def _selector(tensor: torch.Tensor, dim: int) -> Callable[[int], torch.Tensor]:
    return lambda slot: tensor.select(dim, slot)


class InternalLayoutView(PackedSlotView):
    """Experts whose live storage uses an internal blocked layout (models Ascend fractal NZ).

    An NZ tensor ``[S, F1, H1, h0, f0]`` holds, per slot, the blocked form of an ND matrix
    ``[H1*h0, F1*f0]``. A slot's block cannot be sent as a view (its bytes are not the ND values),
    so the payload carries ND: ``pack_slot`` converts the block into the contiguous ND payload
    section (``to_nd``), ``unpack_slot_`` converts the ND section back (``from_nd``) and
    ``copy_``s it into the ORIGINAL storage. Tensors not named in ``nz_names`` are plain
    ``[S, ...]`` tensors (scales, biases) moved as they are.

    Args:
        tensors: live tensors by name, in payload order; every one has the expert dim first.
        nz_names: which tensors are in NZ layout (default: ``("w13", "w2")``).
        format_name: reported name (default ``"nz"``).
    """

    FORMAT = "nz"

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        nz_names: Iterable[str] = ("w13", "w2"),
        *,
        format_name: str = FORMAT,
    ) -> None:
        if not isinstance(tensors, Mapping) or not tensors:
            raise UnsupportedWeightFormat(
                format_name, "tensors must be a non-empty name -> tensor map"
            )
        nz_set = set(nz_names)
        unknown = nz_set - set(tensors)
        if unknown:
            raise UnsupportedWeightFormat(format_name, f"nz_names {sorted(unknown)} are not given")
        if not nz_set:
            raise UnsupportedWeightFormat(
                format_name, "no tensor is in NZ layout (use another format)"
            )
        check = _Checker(format_name)
        fields = []
        for name, tensor in tensors.items():
            nz = name in nz_set
            if nz:
                check.tensor(name, tensor, 3, nz=True)
            elif isinstance(tensor, torch.Tensor) and tensor.dim() >= 1:
                check.tensor(name, tensor, tensor.dim())
            else:
                check.fail(f"{name!r} must be a tensor with a leading expert dimension")
            fields.append(_leading_field(name, tensor, nz))
        assert check.num_slots is not None
        super().__init__(format_name, check.num_slots, fields)


# -- registry ---------------------------------------------------------------------------

ViewFactory = Callable[[Mapping[str, torch.Tensor], dict[str, Any]], PackedSlotView]

#: Formats known NOT to satisfy the contract, with the reason given to the user.
UNSUPPORTED_FORMATS: dict[str, str] = {
    "mxfp4_swizzled": (
        "the kernel reads block scales swizzled across experts' tiles, so one expert's scales "
        "are not a separable slice; an expert cannot be written in place without touching its "
        "neighbours (un-swizzle to per-expert ND scales to enable EPLB)"
    ),
    "nz_whole_tensor_only": (
        "the format exposes only whole-layer NZ tensors; sending whole NZ tensors hung "
        "batch_isend_irecv upstream and NZ slice copies can touch neighbouring experts; expose "
        "per-expert NZ blocks (format 'nz' or '<format>_nz') instead"
    ),
}


def _keyword_factory(cls: type[PackedSlotView], **fixed: Any) -> ViewFactory:
    """Factory for a class whose tensors are keyword parameters: names are checked up front."""
    parameters = inspect.signature(cls).parameters.values()
    tensor_names = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    required = {
        p.name
        for p in parameters
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        and p.default is inspect.Parameter.empty
    }
    option_names = {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY} - set(
        fixed
    )

    def build(tensors: Mapping[str, torch.Tensor], options: dict[str, Any]) -> PackedSlotView:
        fmt = _format_of(cls, fixed)
        unexpected = sorted(set(tensors) - set(tensor_names))
        if unexpected:
            raise UnsupportedWeightFormat(
                fmt, f"unexpected tensors {unexpected}; this format takes {tensor_names}"
            )
        missing = sorted(required - set(tensors))
        if missing:
            raise UnsupportedWeightFormat(fmt, f"missing tensors {missing} (takes {tensor_names})")
        bad_options = sorted(set(options) - option_names)
        if bad_options:
            raise UnsupportedWeightFormat(
                fmt, f"unknown options {bad_options}; accepted: {sorted(option_names)}"
            )
        return cls(**tensors, **fixed, **options)

    return build


def _format_of(cls: type[PackedSlotView], fixed: Mapping[str, Any]) -> str:
    layout = fixed.get("weight_layout", "nd")
    base = getattr(cls, "FORMAT", cls.__name__)
    return base if layout == "nd" else f"{base}_{layout}"


def _mapping_factory(cls: type[PackedSlotView]) -> ViewFactory:
    return lambda tensors, options: cls(tensors, **options)


_REGISTRY: dict[str, ViewFactory] = {
    "unquantized": _keyword_factory(UnquantizedView),
    "unquantized_nz": _keyword_factory(UnquantizedView, weight_layout="nz"),
    "w8a8": _keyword_factory(W8A8View),
    "w8a8_nz": _keyword_factory(W8A8View, weight_layout="nz"),
    "w4a8": _keyword_factory(W4A8View),
    "w4a8_nz": _keyword_factory(W4A8View, weight_layout="nz"),
    "strided_packed": _mapping_factory(StridedPackedView),
    "nz": _mapping_factory(InternalLayoutView),
}


def register_weight_format(format_name: str, factory: ViewFactory) -> None:
    """Register ``factory(tensors, options) -> view`` under ``format_name`` (no overwrite)."""
    if format_name in _REGISTRY or format_name in UNSUPPORTED_FORMATS:
        raise ValueError(f"weight format {format_name!r} is already registered")
    _REGISTRY[format_name] = factory


def supported_formats() -> tuple[str, ...]:
    """Names accepted by :func:`make_expert_view`, sorted."""
    return tuple(sorted(_REGISTRY))


def make_expert_view(
    format_name: str, tensors: Mapping[str, torch.Tensor], **options: Any
) -> ExpertWeightView:
    """Build the view of one MoE layer's experts on this rank for ``format_name``.

    Args:
        format_name: a name from :func:`supported_formats`.
        tensors: the live tensors by parameter name (e.g. ``w13``, ``w2``, ``w13_scale`` ...).
        options: format options (``weight_layout`` is fixed by the ``*_nz`` names;
            ``expert_dim`` for ``strided_packed``; ``nz_names`` for ``nz``).

    Raises:
        UnsupportedWeightFormat: the format is unknown, known to be unmovable, or the tensors do
            not fit it (missing/unexpected names, wrong expert dimension, mismatched dtypes...).
    """
    if not isinstance(format_name, str):
        raise UnsupportedWeightFormat(format_name, "the format name must be a string")
    if format_name in UNSUPPORTED_FORMATS:
        raise UnsupportedWeightFormat(format_name, UNSUPPORTED_FORMATS[format_name])
    factory = _REGISTRY.get(format_name)
    if factory is None:
        raise UnsupportedWeightFormat(
            format_name, f"unknown format; supported formats: {', '.join(supported_formats())}"
        )
    if not isinstance(tensors, Mapping):
        raise UnsupportedWeightFormat(
            format_name, f"tensors must be a mapping, got {type(tensors)}"
        )
    view = factory(tensors, dict(options))
    logger.info(
        "expert weight view %r: %d slots x %d bytes", format_name, view.num_slots, view.slot_nbytes
    )
    return view
