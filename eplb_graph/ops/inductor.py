"""Inductor-only lowering choice for the routing ops.

An opaque custom op is a ``FallbackKernel`` to inductor: it cannot fuse with the router's top-k
or the expert gather. Two cases:
- CPU with the native kernel loaded: keep the op. It is one fused pass already; an inductor
  decomposition would re-derive a dozen loops. Inductor calls it as an extern kernel, at eager cost.
- Every other case (CUDA, NPU, CPU without the native kernel): decompose each op into the ATen
  reference so inductor fuses it with its neighbours (Triton on CUDA, C++ loops on CPU). The
  mutating ops decompose too: inductor re-functionalizes the reference's ``scatter_add_``.

``torch._decomp.register_decomposition`` into inductor's table is a private API; the tests in
``tests/test_inductor_lowering.py`` pin the behaviour on every torch upgrade.
"""

from __future__ import annotations

import torch

from eplb_graph.ops import native
from eplb_graph.ops.reference import map_and_record_ref, map_to_physical_ref, record_load_ref

_installed = False


def keep_opaque(device: torch.device) -> bool:
    """True when inductor should call the op as is on ``device`` (the fused native kernel)."""
    return device.type == "cpu" and native.ensure_loaded()


def _ensure_extern_lowering(handle: torch._ops.OpOverload) -> None:
    """Register the op as an inductor extern call that coexists with its decomposition.

    Inductor's implicit fallback refuses ops that also have a decomposition ("both a fallback and
    a decomp for same op"), so the fallback is registered explicitly with ``override_decomp``.
    """
    from torch._inductor.lowering import lowerings, make_fallback

    if handle not in lowerings:
        make_fallback(handle, warn=False, override_decomp=True)


def _decomposition(handle: torch._ops.OpOverload, reference, device_argument: int):
    def decompose(*args):
        if keep_opaque(args[device_argument].device):
            _ensure_extern_lowering(handle)
            return NotImplemented  # inductor then calls the op itself (extern kernel)
        return reference(*args)

    decompose.__name__ = f"{reference.__name__}_inductor_decomposition"
    return decompose


_DECOMPOSITIONS = {
    "map_to_physical": (map_to_physical_ref, 0),
    "record_load": (record_load_ref, 0),
    "map_and_record": (map_and_record_ref, 0),
}


def install() -> None:
    global _installed
    if _installed:
        return
    from torch._decomp import register_decomposition
    from torch._inductor.decomposition import decompositions

    for name, (reference, device_argument) in _DECOMPOSITIONS.items():
        handle = getattr(torch.ops.eplb_graph, name).default
        register_decomposition(handle, registry=decompositions)(
            _decomposition(handle, reference, device_argument)
        )
    _installed = True
