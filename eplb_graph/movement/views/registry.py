"""The format registry: one name per movable format, and the one way a view is built by name.

Runners and settings name a weight format as a string; :func:`make_expert_view` turns that name
and the layer's live tensors into a view, checking tensor names and options up front so a
misconfigured format fails at initialization with a message that lists what the format takes.
Formats known to be unmovable are rejected here by name, with the reason. A new kernel's format
is added with :func:`register_weight_format`.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from eplb_graph.movement.views.checks import layout_format_name
from eplb_graph.movement.views.contract import ExpertWeightView, UnsupportedWeightFormat
from eplb_graph.movement.views.cpu_int4 import CpuInt4PackedView
from eplb_graph.movement.views.cpu_int8 import CpuInt8PackedView
from eplb_graph.movement.views.formats import (
    InternalLayoutView,
    StridedPackedView,
    UnquantizedView,
    W4A8View,
    W8A8View,
)
from eplb_graph.movement.views.payload import PackedSlotView

logger = logging.getLogger(__name__)

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
    return layout_format_name(
        getattr(cls, "FORMAT", cls.__name__), fixed.get("weight_layout", "nd")
    )


def _mapping_factory(cls: type[PackedSlotView]) -> ViewFactory:
    return lambda tensors, options: cls(tensors, **options)


_REGISTRY: dict[str, ViewFactory] = {
    "unquantized": _keyword_factory(UnquantizedView),
    "unquantized_nz": _keyword_factory(UnquantizedView, weight_layout="nz"),
    "w8a8": _keyword_factory(W8A8View),
    "w8a8_nz": _keyword_factory(W8A8View, weight_layout="nz"),
    "w4a8": _keyword_factory(W4A8View),
    "w4a8_nz": _keyword_factory(W4A8View, weight_layout="nz"),
    "cpu_int8_packed": _keyword_factory(CpuInt8PackedView),
    "cpu_int4_packed": _keyword_factory(CpuInt4PackedView),
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
