"""Fractal NZ <-> ND layout math.

Ascend kernels read expert weights in the blocked ``FRACTAL_NZ`` layout, but a payload always
carries the logical ND form: the bytes of an NZ block are not the matrix values in order, and a
slot's block cannot be sent as a view of its storage. These functions convert between the two
forms, and :func:`nd_as_nz` gives the strided view that lets one ``copy_`` convert in place,
without a temporary, which is how an NZ slot is packed and unpacked.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
