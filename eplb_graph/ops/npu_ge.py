"""torchair GE converters for the three routing ops (torchair's max-autotune / GE graph mode).

Written against torchair as shipped in the ``torch-npu`` 2.14.0 wheel; what is used, where it
lives and what it accepts is recorded in ``torchair_surface.json`` (``tools/
extract_torchair_surface.py``) and tested against it and against the real Python modules
(``tests/test_torchair_converters.py``). The facts that shape this file (docs/ascend.md has the
file:line of each):
- the public ``torchair.ge`` exports only Const, Cast, DataType, ...; every other op builder
  lives in ``torchair._ge_concrete_graph.ge_apis`` (as in torchair's own converters);
- ``Cast(dst_type=...)`` and a converter input's ``.dtype`` are GE ``DataType`` ints, never torch
  dtypes; a GE tensor has no ``__getitem__`` (a dimension is ``Gather(Shape(x), i)``);
- an op with a mutable argument reaches GE through ``auto_functionalized_v2``, which calls the
  converter below with keyword arguments only (the schema's names, no ``meta_outputs``) and then
  takes the updated ``load`` from the *last* op the converter built, by the name of its ref
  output. So ``record_load`` and ``map_and_record`` end with ``InplaceIndexAdd`` on ``load`` (ref
  output ``var``; int32 and int64, unlike ``ScatterAdd``), and ``record_load`` returns nothing.

The graph is the capturable formulation of ``npu_routing.py`` op for op: no shifts, constants
as graph Consts. Nothing here has run on an NPU.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from eplb_graph.ops.npu_routing import GOLDEN_LOW16
from eplb_graph.ops.reference import GOLDEN_HASH

#: Where each piece of torchair's API is imported from (checked against the pinned wheel).
PUBLIC_MODULE = "torchair.ge"
BUILDERS_MODULE = "torchair._ge_concrete_graph.ge_apis"
REGISTER_NAME = "register_fx_node_ge_converter"

_LOW32 = 0xFFFFFFFF
_LOW16 = 0xFFFF
_INT32_MAX = torch.iinfo(torch.int32).max


@dataclass(frozen=True)
class GeApi:
    """The three things the converters use: the registration decorator, the public ``ge``
    module (Const, Cast, DataType) and the op builders module."""

    register: Callable[[Any], Callable]
    ge: ModuleType
    ops: ModuleType


def resolve(torchair: ModuleType) -> GeApi:
    """The API from an imported ``torchair`` (its submodules are imported by name)."""
    return GeApi(
        register=getattr(torchair, REGISTER_NAME),
        ge=importlib.import_module(PUBLIC_MODULE),
        ops=importlib.import_module(BUILDERS_MODULE),
    )


class _Graph:
    """Helpers over one GeApi: int64 constants, casts and dimensions, spelled once."""

    def __init__(self, api: GeApi):
        self.ge, self.ops = api.ge, api.ops
        self.dt = api.ge.DataType

    def const(self, value):
        return self.ge.Const(value, dtype=self.dt.DT_INT64)

    def int64(self, x):
        return x if x.dtype == self.dt.DT_INT64 else self.ge.Cast(x, dst_type=self.dt.DT_INT64)

    def dim(self, x, index: int):
        """``x.shape[index]`` as a 0-d int64 graph tensor (works for symbolic sizes too)."""
        return self.ops.Gather(self.ops.Shape(x, dtype=self.dt.DT_INT64), self.const(index))

    def flat(self, x):
        return self.ops.Reshape(x, self.const([-1]))

    def rows(self, x):
        """``arange(x.shape[0])`` as int64."""
        return self.ops.Range(self.const(0), self.dim(x, 0), self.const(1))

    def usable(self, entry, table_dtype, out_dtype):
        """``0 <= entry <= max(out_dtype)`` (``reference._usable_slot``)."""
        usable = self.ops.GreaterEqual(entry, self.const(0))
        if table_dtype == self.dt.DT_INT64 and out_dtype == self.dt.DT_INT32:
            usable = self.ops.LogicalAnd(usable, self.ops.LessEqual(entry, self.const(_INT32_MAX)))
        return usable

    def replica_hash(self, rows, offset):
        """``npu_routing.replica_hash_npu`` in GE ops (no shift)."""
        ops, low32 = self.ops, self.const(_LOW32)
        x = ops.BitwiseAnd(ops.Add(rows, ops.BitwiseAnd(offset, low32)), low32)
        low = ops.BitwiseAnd(x, self.const(_LOW16))
        product = ops.Add(
            ops.Mul(low, self.const(GOLDEN_HASH)),
            ops.Mul(ops.Sub(x, low), self.const(GOLDEN_LOW16)),
        )
        return ops.BitwiseAnd(product, low32)

    def map(self, topk_ids, log2phy, replica_count, offset):
        """(physical int64 [T, K], physical in topk_ids' dtype): ``npu_routing._map``."""
        ops = self.ops
        zero, one = self.const(0), self.const(1)
        ids = self.int64(topk_ids)
        num_experts, width = self.dim(log2phy, 0), self.dim(log2phy, 1)
        valid = ops.LogicalAnd(ops.GreaterEqual(ids, zero), ops.Less(ids, num_experts))
        safe_ids = ops.SelectV2(valid, ids, zero)
        count = ops.Maximum(ops.GatherV2(self.int64(replica_count), safe_ids, zero), one)
        row_hash = ops.Unsqueeze(self.replica_hash(self.rows(topk_ids), offset), axes=[1])
        replica = ops.Minimum(ops.FloorMod(row_hash, count), ops.Sub(width, one))
        table = self.flat(self.int64(log2phy))
        row_start = ops.Mul(safe_ids, width)
        physical = ops.GatherV2(table, ops.Add(row_start, replica), zero)
        first = ops.GatherV2(table, row_start, zero)
        physical = ops.SelectV2(
            self.usable(physical, log2phy.dtype, topk_ids.dtype), physical, first
        )
        keep = ops.LogicalAnd(valid, self.usable(physical, log2phy.dtype, topk_ids.dtype))
        physical = ops.SelectV2(keep, physical, self.const(-1))
        if topk_ids.dtype == self.dt.DT_INT64:
            return physical, physical
        return physical, self.ge.Cast(physical, dst_type=topk_ids.dtype)

    def record(self, load, ids, num_valid_tokens, record_enabled):
        """``npu_routing._record`` of int64 ``ids``; the last op built is the ref op writing
        ``load``. (Only graph inputs have a known ``.dtype``: a builder's output is
        ``DT_UNDEFINED`` until torchair sets its meta, so ``ids`` must already be int64.)"""
        ops, zero = self.ops, self.const(0)
        row_counts = ops.LogicalAnd(
            ops.Less(self.rows(ids), self.int64(num_valid_tokens)), record_enabled
        )
        in_range = ops.LogicalAnd(ops.GreaterEqual(ids, zero), ops.Less(ids, self.dim(load, 0)))
        counted = ops.LogicalAnd(ops.Unsqueeze(row_counts, axes=[1]), in_range)
        safe_ids = self.flat(ops.SelectV2(counted, ids, zero))
        updates = self.ge.Cast(self.flat(counted), dst_type=load.dtype)
        return ops.InplaceIndexAdd(load, safe_ids, updates, None, axis=0)


def register_converters(api: GeApi) -> list[str]:
    """Register a converter for each routing op; returns the op names, in registration order.

    Parameter names are the schema's (``auto_functionalized_v2`` passes them as keywords).
    """
    graph = _Graph(api)
    ops = torch.ops.eplb_graph

    @api.register(ops.map_to_physical.default)
    def convert_map_to_physical(topk_ids, log2phy, replica_count, offset):
        return graph.map(topk_ids, log2phy, replica_count, offset)[1]

    @api.register(ops.record_load.default)
    def convert_record_load(load, physical_ids, num_valid_tokens, record_enabled):
        graph.record(load, graph.int64(physical_ids), num_valid_tokens, record_enabled)

    @api.register(ops.map_and_record.default)
    def convert_map_and_record(
        topk_ids, log2phy, replica_count, offset, load, num_valid_tokens, record_enabled
    ):
        physical, out = graph.map(topk_ids, log2phy, replica_count, offset)
        graph.record(load, physical, num_valid_tokens, record_enabled)
        return out

    return ["map_to_physical", "record_load", "map_and_record"]
