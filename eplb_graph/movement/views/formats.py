"""The concrete weight formats: which tensors a kernel reads for one expert, and their rules.

Each class names the tensors one family of fused MoE kernels reads per expert, checks them while
the view is built (shapes, dtypes, storage layout), and hands them to the payload engine as
fields in payload order. Two families are about storage rather than quantization: experts laid
out along a non-leading dimension (:class:`StridedPackedView`) and experts in an internal
blocked layout (:class:`InternalLayoutView`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from eplb_graph.movement.views import table
from eplb_graph.movement.views.checks import FormatChecker
from eplb_graph.movement.views.contract import UnsupportedWeightFormat
from eplb_graph.movement.views.payload import PackedSlotView, SlotField


class UnquantizedView(table.TensorTableView):
    """Float experts: ``w13 [S, 2I, H]``, ``w2 [S, H, I]``, optional ``w13_bias [S, 2I]`` and
    ``w2_bias [S, H]``; any floating dtype (all tensors the same).

    ``weight_layout="nz"``: ``w13``/``w2`` are stored in fractal NZ
    (``[S, H/f0, 2I/h0, h0, f0]`` and ``[S, I/f0, H/h0, h0, f0]``); shapes above are their ND form.
    """

    FORMAT = "unquantized"
    TENSORS = table.WEIGHTS
    OPTIONAL_TENSORS = ("w13_bias", "w2_bias")
    WEIGHT_LAYOUT = True

    def _lay_out(self, check: FormatChecker, tensors: table.Tensors) -> table.Layout:
        w13_shape, w2_shape, fields = table.expert_weights(check, tensors, floating=True)
        check.gated_mlp(w13_shape, w2_shape)
        for name, width in (("w13_bias", w13_shape[1]), ("w2_bias", w2_shape[1])):
            bias = tensors[name]
            if bias is None:
                continue
            shape = check.tensor(name, bias, 2)
            check.same_dtype(("w13", tensors["w13"]), (name, bias))
            check.equal(f"{name}.shape[1]", shape[1], width)
            fields.append(table.leading_field(name, bias))
        return fields, {}


class W8A8View(table.TensorTableView):
    """Int8 experts with per-channel scales, moved as one payload per expert.

    Moved: ``w13`` int8 ``[S, 2I, H]``, ``w2`` int8 ``[S, H, I]``, ``w13_scale`` fp32 ``[S, 2I]``,
    ``w2_scale`` fp32 ``[S, H]``, ``w13_fused_scale`` int64 ``[S, 2I]`` and ``w2_fused_scale``
    int64 ``[S, H]`` (the fp32 scales packed into int64 for fused MC2 kernels).

    NOT moved: ``w13_offset``/``w2_offset``. With symmetric quantization the kernel never reads
    them, so moving them would only cost bytes; they are kept as :meth:`unmoved_tensors` so their
    addresses are still checked, and after a rearrangement they describe the slot's previous
    expert. Do not use this view for asymmetric kernels.

    ``weight_layout="nz"``: the int8 weights are stored in fractal NZ (see
    :class:`UnquantizedView`); scales stay ND.
    """

    FORMAT = "w8a8"
    #: The weights, then their per-channel scales (moved, in this order after the weights).
    TENSORS = (*table.WEIGHTS, "w13_scale", "w2_scale", "w13_fused_scale", "w2_fused_scale")
    #: Offsets: checked, not moved.
    OPTIONAL_TENSORS = ("w13_offset", "w2_offset")
    WEIGHT_LAYOUT = True
    _PACK = 1  # values per stored int8

    def _lay_out(self, check: FormatChecker, tensors: table.Tensors) -> table.Layout:
        w13_shape, w2_shape, fields = table.expert_weights(check, tensors, (torch.int8,))
        check.gated_mlp(w13_shape, w2_shape, self._PACK)
        widths = {"w13": w13_shape[1], "w2": w2_shape[1]}
        for name in self.TENSORS[len(table.WEIGHTS) :]:
            dtype = torch.int64 if name.endswith("fused_scale") else torch.float32
            _check_per_output_channel(check, name, tensors[name], widths, (dtype,))
            fields.append(table.leading_field(name, tensors[name]))
        unmoved = {}
        for name in self.OPTIONAL_TENSORS:
            if tensors[name] is None:
                continue
            _check_per_output_channel(check, name, tensors[name], widths)
            unmoved[name] = tensors[name]
        return fields, unmoved


class W4A8View(W8A8View):
    """W8A8 plus fp32 ``w13_scale_bias [S, 2I]`` and ``w2_scale_bias [S, H]``.

    Int4 weights are stored two per int8: ``w13`` int8 ``[S, 2I, H/2]``, ``w2`` int8
    ``[S, H, I/2]``. The scale biases are read by the kernel, so they travel in the payload;
    offsets do not (see :class:`W8A8View`).
    """

    FORMAT = "w4a8"
    TENSORS = (*W8A8View.TENSORS, "w13_scale_bias", "w2_scale_bias")
    _PACK = 2


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
        _require_tensor_map(format_name, tensors)
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


class InternalLayoutView(PackedSlotView):
    """Experts whose live storage uses an internal blocked layout (models Ascend fractal NZ).

    An NZ tensor ``[S, F1, H1, h0, f0]`` holds, per slot, the blocked form of an ND matrix
    ``[H1*h0, F1*f0]``. A slot's block cannot be sent as a view (its bytes are not the ND values),
    so the payload carries ND: ``pack_slot`` converts the block into the contiguous ND payload
    section (``to_nd``), ``unpack_slot_`` converts the ND section back (``from_nd``) and
    ``copy_``s it into the ORIGINAL storage. table.Tensors not named in ``nz_names`` are plain
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
        _require_tensor_map(format_name, tensors)
        nz_set = set(nz_names)
        unknown = nz_set - set(tensors)
        if unknown:
            raise UnsupportedWeightFormat(format_name, f"nz_names {sorted(unknown)} are not given")
        if not nz_set:
            raise UnsupportedWeightFormat(
                format_name, "no tensor is in NZ layout (use another format)"
            )
        check = FormatChecker(format_name)
        fields = []
        for name, tensor in tensors.items():
            nz = name in nz_set
            if nz:
                check.tensor(name, tensor, 3, nz=True)
            elif isinstance(tensor, torch.Tensor) and tensor.dim() >= 1:
                check.tensor(name, tensor, tensor.dim())
            else:
                check.fail(f"{name!r} must be a tensor with a leading expert dimension")
            fields.append(table.leading_field(name, tensor, nz))
        assert check.num_slots is not None
        super().__init__(format_name, check.num_slots, fields)


# -- building blocks shared by the formats above --------------------------------------------------


def _check_per_output_channel(
    check: FormatChecker,
    name: str,
    tensor: torch.Tensor,
    widths: Mapping[str, int],
    dtypes: Iterable[torch.dtype] | None = None,
) -> None:
    """``<owner>_... [S, C]`` with one value per output channel ``C`` of weight ``<owner>``."""
    owner = name.split("_", 1)[0]
    shape = check.tensor(name, tensor, 2, dtypes)
    check.equal(f"{name}.shape[1] (output channels of {owner})", shape[1], widths[owner])


def _selector(tensor: torch.Tensor, dim: int) -> Callable[[int], torch.Tensor]:
    return lambda slot: tensor.select(dim, slot)


def _require_tensor_map(format_name: str, tensors: object) -> None:
    if not isinstance(tensors, Mapping) or not tensors:
        raise UnsupportedWeightFormat(format_name, "tensors must be a non-empty name -> tensor map")
