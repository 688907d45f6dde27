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

logger = logging.getLogger(__name__)

_library: torch.library.Library | None = None


def _kernels():
    from eplb_graph.ops import triton_routing

    return triton_routing


def map_to_physical_cuda(topk_ids, log2phy, replica_count, offset):
    check_map_args(topk_ids, log2phy, replica_count, offset)
    return _kernels().route(topk_ids, log2phy, replica_count, offset, None, None, None)


def record_load_cuda(load, physical_ids, num_valid_tokens, record_enabled):
    check_record_args(load, physical_ids, num_valid_tokens, record_enabled)
    _kernels().record(load, physical_ids, num_valid_tokens, record_enabled)


def map_and_record_cuda(
    topk_ids, log2phy, replica_count, offset, load, num_valid_tokens, record_enabled
):
    check_map_and_record_args(
        topk_ids, log2phy, replica_count, offset, load, num_valid_tokens, record_enabled
    )
    return _kernels().route(
        topk_ids, log2phy, replica_count, offset, load, num_valid_tokens, record_enabled
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
