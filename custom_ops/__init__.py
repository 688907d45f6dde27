"""The eplb_graph op library: ``torch.ops.eplb_graph.{map_to_physical, record_load,
map_and_record}``.

Importing this package defines the schemas, registers fake kernels (for torch.compile and
opcheck), the device-agnostic ATen reference kernels, the inductor decompositions, the fused
native CPU kernel (built on first use) and, where torch_npu is importable, the NPU registrations.
"""

from __future__ import annotations

from custom_ops import _library, inductor, native, npu
from custom_ops.ops import map_and_record, map_to_physical, record_load
from custom_ops.reference import (
    GOLDEN_HASH,
    map_and_record_ref,
    map_to_physical_ref,
    record_load_ref,
    replica_hash,
)

native.install()
inductor.install()
npu.install()

op_handles = _library.op_handles

__all__ = [
    "GOLDEN_HASH",
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
