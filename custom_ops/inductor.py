"""Inductor-only lowering choice for the routing ops.

An opaque custom op is a ``FallbackKernel`` to inductor: it cannot fuse with the router's top-k
or the expert gather. Two cases:
- CPU with the native kernel loaded: keep the op. It is one fused pass already; an inductor
  decomposition would re-derive a dozen loops. Inductor calls it as an extern kernel, at eager cost.
- Every other case (CUDA, NPU, CPU without the native kernel): decompose ``map_to_physical`` into
  the ATen reference so inductor fuses it (Triton on CUDA, C++ loops on CPU).

Only the pure ``map_to_physical`` is decomposed: the mutating ops are functionalized before the
decomposition table is consulted, so they stay extern calls (a single scatter_add on device).
``torch._decomp.register_decomposition`` into inductor's table is a private API; the tests in
``tests/test_inductor_lowering.py`` pin the behaviour on every torch upgrade.
"""

from __future__ import annotations

import torch

from custom_ops import native
from custom_ops.reference import map_to_physical_ref

_installed = False


def keep_opaque(device: torch.device) -> bool:
    """True when inductor should call the op as is on ``device`` (the fused native kernel)."""
    return device.type == "cpu" and native.ensure_loaded()


def _map_to_physical_decomposition(topk_ids, log2phy, replica_count, offset):
    if keep_opaque(topk_ids.device):
        return NotImplemented
    return map_to_physical_ref(topk_ids, log2phy, replica_count, offset)


def install() -> None:
    global _installed
    if _installed:
        return
    from torch._decomp import register_decomposition
    from torch._inductor.decomposition import decompositions

    register_decomposition(torch.ops.eplb_graph.map_to_physical.default, registry=decompositions)(
        _map_to_physical_decomposition
    )
    _installed = True
