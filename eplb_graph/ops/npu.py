"""Ascend NPU registration, import-guarded: CPU-only machines must never import torch_npu.

What an NPU graph mode needs for a custom op (torchair docs, see docs/architecture.md):
- aclgraph / npugraph_ex (reduce-overhead): schema, fake kernel, a PrivateUse1 kernel, and
  functionalization for the in-place op (automatic for ``Tensor(a!)`` schemas returning nothing
  aliased). The PrivateUse1 kernel is ``npu_routing``: the reference's result computed only with
  aclnn ops, no int64 shift and no per-call host scalar (docs/ascend.md).
- torchair GE (max-autotune): additionally a converter from the FX node to Ascend IR for each of
  the three ops (``npu_ge``), registered with ``torchair.register_fx_node_ge_converter``.

Nothing here has run on an NPU: see docs/ascend.md for what is checked against the real torchair
and op-plugin sources and what only against fakes built from them.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from types import ModuleType

import torch

from eplb_graph.ops.npu_ge import register_converters, resolve
from eplb_graph.ops.npu_routing import map_and_record_npu, map_to_physical_npu, record_load_npu
from eplb_graph.ops.registration import NAMESPACE

logger = logging.getLogger(__name__)

_registered: dict[str, object] = {}


def _import_optional(name: str) -> ModuleType | None:
    """Import ``name`` if present; any failure (e.g. torch_npu without CANN) means absent."""
    try:
        if importlib.util.find_spec(name) is None:
            return None
        return importlib.import_module(name)
    except Exception as error:  # ImportError for libhccl.so, RuntimeError from autoload, ...
        logger.info("eplb_graph: %s present but not importable (%s); NPU path off", name, error)
        return None


def register_privateuse1_kernels() -> torch.library.Library:
    """Register the capturable formulation (``npu_routing``) for PrivateUse1 (``npu``)."""
    library = torch.library.Library(NAMESPACE, "IMPL")
    library.impl("map_to_physical", map_to_physical_npu, "PrivateUse1")
    library.impl("record_load", record_load_npu, "PrivateUse1")
    library.impl("map_and_record", map_and_record_npu, "PrivateUse1")
    return library


def register_torchair_converters(torchair: ModuleType) -> list[str]:
    """Register the GE converters of all three routing ops (``npu_ge``); returns their names."""
    names = register_converters(resolve(torchair))
    _registered["torchair"] = names
    return names


def install() -> dict[str, object]:
    """Register NPU kernels when torch_npu imports cleanly; never raises on a CPU-only machine."""
    if _registered:
        return _registered
    torch_npu = _import_optional("torch_npu")
    if torch_npu is None:
        return _registered
    _registered["privateuse1"] = register_privateuse1_kernels()
    torchair = _import_optional("torchair") or _import_optional("torch_npu.dynamo.torchair")
    if torchair is not None:
        try:
            register_torchair_converters(torchair)
        except Exception as error:
            logger.warning("eplb_graph: torchair GE converters not registered: %s", error)
    return _registered
