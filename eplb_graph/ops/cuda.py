"""CUDA kernels of the routing ops: the Triton kernels of ``triton_routing``, where triton is.

Registered for the ``CUDA`` dispatch key when triton is installed (it ships with every CUDA
build of torch); the kernels themselves are compiled on the first CUDA call, so importing
eplb_graph never imports triton. Without triton, CUDA calls keep the ATen reference (correct,
about thirty kernel launches per call) and that is logged once at install. Under
``torch.compile`` inductor still decomposes the ops into the reference on CUDA and fuses them
with their neighbours (``inductor``): these kernels serve eager calls and raw captured graphs.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from eplb_graph.ops.checks import check_map_and_record_args, check_map_args, check_record_args
from eplb_graph.ops.registration import NAMESPACE
from eplb_graph.ops.signatures import checked_kernel

logger = logging.getLogger(__name__)

_library: torch.library.Library | None = None


def _kernels():
    from eplb_graph.ops import triton_routing

    return triton_routing


def _map(*args: torch.Tensor) -> torch.Tensor:
    return _kernels().route(*args, None, None, None)  # no load: map only


def _map_and_record(*args: torch.Tensor) -> torch.Tensor:
    return _kernels().route(*args)  # one fused pass


def _record(*args: torch.Tensor) -> None:
    _kernels().record(*args)


map_to_physical_cuda = checked_kernel(
    "map_to_physical",
    check_map_args,
    _map,
    __name__,
    "map_to_physical_cuda",
    "``map_to_physical`` for CUDA.",
)
record_load_cuda = checked_kernel(
    "record_load",
    check_record_args,
    _record,
    __name__,
    "record_load_cuda",
    "``record_load`` for CUDA.",
)
map_and_record_cuda = checked_kernel(
    "map_and_record",
    check_map_and_record_args,
    _map_and_record,
    __name__,
    "map_and_record_cuda",
    "``map_and_record`` for CUDA: one fused pass.",
)


def install() -> bool:
    """Register the Triton kernels for CUDA when triton is installed; True when registered."""
    global _library
    if _library is not None:
        return True
    if importlib.util.find_spec("triton") is None:
        logger.info("eplb_graph: triton is not installed; CUDA routing uses the ATen reference")
        return False
    _library = torch.library.Library(NAMESPACE, "IMPL")
    _library.impl("map_to_physical", map_to_physical_cuda, "CUDA")
    _library.impl("record_load", record_load_cuda, "CUDA")
    _library.impl("map_and_record", map_and_record_cuda, "CUDA")
    return True
