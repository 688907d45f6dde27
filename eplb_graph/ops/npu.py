"""Ascend NPU registration, import-guarded: CPU-only machines must never import torch_npu.

What an NPU graph mode needs for a custom op (torchair docs, see docs/architecture.md):
- aclgraph / npugraph_ex (reduce-overhead): schema, fake kernel, a PrivateUse1 kernel, and
  functionalization for the in-place op (automatic for ``Tensor(a!)`` schemas returning nothing
  aliased). The PrivateUse1 kernel here is the ATen reference, composed only of aclnn-capturable
  ops (arange, bitwise ops, remainder, index_select, where, scatter_add).
- torchair GE (max-autotune): additionally a converter from the FX node to Ascend IR, registered
  with ``torchair.register_fx_node_ge_converter`` when torchair is importable.

Nothing here has run on an NPU: it is tested against fakes of the torch_npu/torchair interface
(``tests/test_npu_registration.py``) and must be verified on Ascend hardware.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from types import ModuleType

import torch

from eplb_graph.ops.reference import map_and_record_ref, map_to_physical_ref, record_load_ref
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
    """Register the reference kernels for PrivateUse1 (``npu`` once torch_npu renamed it)."""
    library = torch.library.Library(NAMESPACE, "IMPL")
    library.impl("map_to_physical", map_to_physical_ref, "PrivateUse1")
    library.impl("record_load", record_load_ref, "PrivateUse1")
    library.impl("map_and_record", map_and_record_ref, "PrivateUse1")
    return library


def register_torchair_converters(torchair: ModuleType) -> list[str]:
    """Register GE converters composing Ascend IR ops, for torchair's max-autotune mode.

    The converter mirrors the reference kernel op by op (Gather, FloorMod, Select,
    ScatterAdd); returns the names of the ops registered.
    """
    ge = torchair.ge
    register = torchair.register_fx_node_ge_converter
    ops = torch.ops.eplb_graph
    names = []

    def _hash(num_rows, offset):
        rows = ge.Range(0, num_rows, 1)
        # The offset is reduced mod 2**32 first, so the add never overflows int64.
        low_offset = ge.BitwiseAnd(offset, 0xFFFFFFFF)
        x = ge.BitwiseAnd(ge.Add(ge.Cast(rows, dst_type=torch.int64), low_offset), 0xFFFFFFFF)
        low = ge.BitwiseAnd(x, 0xFFFF)
        high = ge.RightShift(x, 16)
        product = ge.Add(
            ge.Mul(low, 2654435769),
            ge.LeftShift(ge.BitwiseAnd(ge.Mul(high, 2654435769), 0xFFFF), 16),
        )
        return ge.BitwiseAnd(product, 0xFFFFFFFF)

    def _usable(entry, out_dtype):
        # A slot id the output dtype holds (reference._usable_slot): never a wrapped id.
        usable = ge.GreaterEqual(entry, 0)
        if out_dtype == torch.int32:
            usable = ge.LogicalAnd(usable, ge.LessEqual(entry, torch.iinfo(torch.int32).max))
        return usable

    @register(ops.map_to_physical.default)
    def convert_map(topk_ids, log2phy, replica_count, offset, meta_outputs=None):
        # Same steps as reference.map_to_physical_ref, in Ascend IR.
        num_experts, width = log2phy.symsize[0], log2phy.symsize[1]
        ids = ge.Cast(topk_ids, dst_type=torch.int64)
        valid = ge.LogicalAnd(ge.GreaterEqual(ids, 0), ge.Less(ids, num_experts))
        safe_ids = ge.Select(valid, ids, ge.ZerosLike(ids))
        count = ge.Maximum(
            ge.Cast(ge.GatherV2(replica_count, safe_ids, 0), dst_type=torch.int64), 1
        )
        row_hash = ge.ExpandDims(_hash(ge.Shape(topk_ids)[0], offset), 1)
        replica = ge.Minimum(ge.FloorMod(row_hash, count), width - 1)
        table = ge.Cast(ge.Reshape(log2phy, [-1]), dst_type=torch.int64)
        row_start = ge.Mul(safe_ids, width)
        physical = ge.GatherV2(table, ge.Add(row_start, replica), 0)
        first = ge.GatherV2(table, row_start, 0)
        physical = ge.Select(_usable(physical, topk_ids.dtype), physical, first)
        keep = ge.LogicalAnd(valid, _usable(physical, topk_ids.dtype))
        physical = ge.Select(keep, physical, ge.Fill(ge.Shape(physical), -1))
        return ge.Cast(physical, dst_type=topk_ids.dtype)

    names.append("map_to_physical")
    _registered["torchair_map_to_physical"] = convert_map
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
