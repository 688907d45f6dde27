"""The ops ``torch.ops.eplb_graph.*``: routing (``map_to_physical``, ``record_load``,
``map_and_record``) and expert compute (``local_experts``, ``local_experts_w8a8``).

Importing this subpackage (``import eplb_graph`` does) defines the schemas, registers the fake
kernels (for torch.compile and opcheck), the device-agnostic ATen reference kernels, the inductor
lowering choice, the fused native CPU kernel (built on first use from ``custom_ops/csrc``), the
Triton kernels for CUDA (``cuda``, ``triton_routing``; where triton is installed) and, where
torch_npu is importable, the NPU registrations.

Modules: ``signatures`` (each op's schema, written once, and what derives from it),
``registration`` (definitions, fakes), ``checks`` (input checks shared by fakes and
reference), ``reference`` (the oracle), ``native`` (CPU kernel loader), ``inductor``, ``npu``,
``wrappers`` (the typed Python entry points re-exported here).
"""

from __future__ import annotations

from eplb_graph.ops import cuda, inductor, native, npu
from eplb_graph.ops.checks import INDEX_DTYPES
from eplb_graph.ops.reference import (
    GOLDEN_HASH,
    local_experts_ref,
    local_experts_w8a8_ref,
    map_and_record_ref,
    map_to_physical_ref,
    record_load_ref,
    replica_hash,
)
from eplb_graph.ops.registration import op_handles
from eplb_graph.ops.wrappers import (
    local_experts,
    local_experts_w8a8,
    map_and_record,
    map_to_physical,
    record_load,
)

native.install()
cuda.install()
inductor.install()
npu.install()

__all__ = [
    "GOLDEN_HASH",
    "INDEX_DTYPES",
    "local_experts",
    "local_experts_ref",
    "local_experts_w8a8",
    "local_experts_w8a8_ref",
    "map_and_record",
    "map_and_record_ref",
    "map_to_physical",
    "map_to_physical_ref",
    "native",
    "op_handles",
    "record_load",
    "record_load_ref",
    "replica_hash",
]
