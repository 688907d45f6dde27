"""A format's table of tensors: the one list its constructor and its payload derive from.

The per-expert formats take their tensors as parameters (``w13``, ``w2``, ``w13_scale``...), so a
view can be built positionally, by keyword, or by name through the registry, which reads the
tensor names and options from the constructor's signature. Written out by hand, every format
repeated the same parameter list (and W4A8 all of W8A8's); here a format states its tensors once,
as class attributes, and :class:`TensorTableView` derives the signature from them, binds the
call, makes the checker and hands the result to the payload engine. The first steps every
gated-MLP format shares (checking ``w13``/``w2``, making leading-dimension fields) live beside it.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from eplb_graph.movement.views.checks import FormatChecker, layout_format_name
from eplb_graph.movement.views.nz import nd_as_nz, nz_to_nd_shape
from eplb_graph.movement.views.payload import PackedSlotView, SlotField

#: The two projections of a gated MLP expert, first in every format's table.
WEIGHTS = ("w13", "w2")

#: The tensors a format was given, by name; an optional one left out is ``None``.
Tensors = Mapping[str, Any]

Shape = tuple[int, ...]

#: What a format lays out: the payload's fields in order, and the tensors deliberately left out
#: of it (checked, not moved) by name.
Layout = tuple[list[SlotField], dict[str, torch.Tensor]]


class TensorTableView(PackedSlotView):
    """A :class:`PackedSlotView` whose tensors are listed in a table on the class.

    A subclass sets :attr:`FORMAT`, :attr:`TENSORS`, :attr:`OPTIONAL_TENSORS` and
    :attr:`WEIGHT_LAYOUT`, and implements :meth:`_lay_out`. Its constructor then takes the
    tensors in table order (positionally or by keyword; the optional ones default to ``None``)
    and, when the format has storage layouts, a keyword-only ``weight_layout="nd"``.
    """

    FORMAT: ClassVar[str]
    #: Tensors the format requires, in parameter order.
    TENSORS: ClassVar[tuple[str, ...]] = ()
    #: Tensors that may be left out (``None``), in parameter order after the required ones.
    OPTIONAL_TENSORS: ClassVar[tuple[str, ...]] = ()
    #: Whether the weights may be stored in another layout (``weight_layout="nz"``).
    WEIGHT_LAYOUT: ClassVar[bool] = False
    __signature__: ClassVar[inspect.Signature]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__signature__ = _table_signature(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            bound = self.__signature__.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{type(self).__name__}(): {error}") from None
        bound.apply_defaults()
        layout = bound.arguments.get("weight_layout", "nd")
        check = FormatChecker(layout_format_name(self.FORMAT, layout), layout)
        names = (*self.TENSORS, *self.OPTIONAL_TENSORS)
        fields, unmoved = self._lay_out(check, {name: bound.arguments[name] for name in names})
        assert check.num_slots is not None  # every format checks at least one tensor
        super().__init__(check.format_name, check.num_slots, fields, unmoved=unmoved)

    def _lay_out(self, check: FormatChecker, tensors: Tensors) -> Layout:
        """Check ``tensors`` with ``check`` and lay them out (see :data:`Layout`)."""
        raise NotImplementedError


def expert_weights(
    check: FormatChecker,
    tensors: Tensors,
    dtypes: tuple[torch.dtype, ...] | None = None,
    *,
    floating: bool = False,
) -> tuple[Shape, Shape, list[SlotField]]:
    """Check an expert's gate+up (``w13``) and down (``w2``) projections and make their fields.

    Every gated-MLP format starts the same way: both weights are ``[S, ...]`` (in NZ when the
    checker's layout says so) of one dtype. How their shapes fit one MLP is the format's rule
    (:meth:`FormatChecker.gated_mlp`, or appended bytes). Returns the ND shapes of ``w13`` and
    ``w2`` and their two fields.
    """
    nz = check.layout == "nz"
    w13, w2 = tensors["w13"], tensors["w2"]
    w13_shape = check.tensor("w13", w13, 3, dtypes, floating=floating, nz=nz)
    w2_shape = check.tensor("w2", w2, 3, dtypes, floating=floating, nz=nz)
    check.same_dtype(("w13", w13), ("w2", w2))
    return w13_shape, w2_shape, [leading_field("w13", w13, nz), leading_field("w2", w2, nz)]


def leading_field(name: str, tensor: torch.Tensor, nz: bool = False) -> SlotField:
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


def _table_signature(cls: type[TensorTableView]) -> inspect.Signature:
    """The constructor's signature, as it would read written out by hand (the registry and
    ``help()`` read it)."""
    param = inspect.Parameter
    parameters = [
        param(name, param.POSITIONAL_OR_KEYWORD, annotation="torch.Tensor") for name in cls.TENSORS
    ]
    parameters += [
        param(name, param.POSITIONAL_OR_KEYWORD, default=None, annotation="torch.Tensor | None")
        for name in cls.OPTIONAL_TENSORS
    ]
    if cls.WEIGHT_LAYOUT:
        parameters.append(
            param("weight_layout", param.KEYWORD_ONLY, default="nd", annotation="str")
        )
    return inspect.Signature(parameters, return_annotation="None")
