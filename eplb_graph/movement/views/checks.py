"""Input checks for the concrete formats, each failure naming the format and the tensor.

A format must reject tensors that do not fit it while the view is built, with a message a user
can act on ("'w2_scale' has 5 experts in its leading dimension but 'w13' has 4"), never at the
first rearrangement. The payload engine's own checks (views of the live storage, aliasing) are
format-agnostic; these are the shape, dtype and layout rules a format states about its tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

import torch

from eplb_graph.movement.views.contract import UnsupportedWeightFormat
from eplb_graph.movement.views.nz import nz_to_nd_shape

#: Storage layouts a format's weights may use: logical row-major, or Ascend fractal NZ.
LAYOUTS = ("nd", "nz")


def layout_format_name(base: str, layout: object) -> str:
    """The registry name of format ``base`` stored in ``layout`` (``w8a8``, ``w8a8_nz``)."""
    return base if layout == "nd" else f"{base}_{layout}"


class FormatChecker:
    """Shape/dtype checks shared by the format classes; every failure names the format."""

    def __init__(self, format_name: str, layout: str = "nd") -> None:
        self.format_name = format_name
        self.layout = layout
        if layout not in LAYOUTS:
            self.fail(f"weight_layout must be one of {LAYOUTS}, got {layout!r}")
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

    def gated_mlp(self, w13: tuple[int, ...], w2: tuple[int, ...], pack: int = 1) -> None:
        """``w13 [S, 2I, H/pack]`` and ``w2 [S, H, I/pack]``: ``pack`` values per stored element."""
        self.equal("hidden size: w13.shape[2] * pack vs w2.shape[1]", w13[2] * pack, w2[1])
        self.equal("gate+up rows: w13.shape[1] vs 2 * w2.shape[2] * pack", w13[1], 2 * w2[2] * pack)
