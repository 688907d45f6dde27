"""The routing ops in a form an ACL graph can capture: the NPU (PrivateUse1) kernels.

The ATen reference (``reference.py``) is the oracle, but three of its habits are wrong on Ascend
(sources: docs/ascend.md):
- ``x >> 16`` / ``<< 16`` on int64: CANN runs int64 shifts as AICPU kernels, and with a Python
  int op-plugin copies the scalar host-to-device on every call (``__Rshift__KernelNpuOpApi.cpp``).
- Python numbers in ``torch.where``/``maximum``/``minimum``/``mul``/``add``: op-plugin turns each
  into a device tensor with ``copy_scalar_to_device`` per call; inside a captured graph that is a
  host copy baked into the graph.
- ``clamp_min``/``clamp_max`` with a number: the same scalar path.

So this formulation computes the same replica choice with only add, sub, mul, bitwise_and and
remainder on int64 (the shifts become a split into a low half and ``x - low``), compares and
selects against 0-d *device* tensors created once per device and value (:func:`prepare`), and uses
only ops that op-plugin sends to an aclnn kernel (listed in docs/ascend.md). Its results equal the
CPU kernels' bit for bit (``tests/test_npu_routing.py`` runs it on CPU against both).

Nothing here has run on an NPU.
"""

from __future__ import annotations

import threading

import torch

from eplb_graph.errors import EplbError
from eplb_graph.ops.checks import check_map_and_record_args, check_map_args, check_record_args
from eplb_graph.ops.reference import GOLDEN_HASH, map_then_record
from eplb_graph.ops.signatures import checked_kernel

_LOW32 = 0xFFFFFFFF
_LOW16 = 0xFFFF
#: ``GOLDEN_HASH mod 2**16``: ``(high * 2**16 * G) mod 2**32 == ((x - low) * G_low16) mod 2**32``.
GOLDEN_LOW16 = GOLDEN_HASH & _LOW16
_INT32_MAX = torch.iinfo(torch.int32).max
#: The values every call needs, whatever the table shapes.
_FIXED_VALUES = (0, 1, -1, _LOW16, _LOW32, GOLDEN_HASH, GOLDEN_LOW16, _INT32_MAX)


class NpuCaptureError(EplbError, RuntimeError):
    """A routing constant was missing while the device stream was being captured.

    Creating it then would bake a host-to-device copy into the graph; call :func:`prepare`
    (or run the op once eagerly) before capture.
    """


_lock = threading.Lock()
_constants: dict[tuple[torch.device, int], torch.Tensor] = {}


def _capturing(device: torch.device) -> bool:
    backend = getattr(torch, device.type, None)
    probe = getattr(backend, "is_current_stream_capturing", None)
    return bool(probe()) if callable(probe) else False


def prepare(device: torch.device | str, values: tuple[int, ...] = ()) -> None:
    """Create the 0-d int64 constants on ``device`` now (one host copy each, ever).

    ``values``: the shape-derived ones (number of experts, table width and width - 1, number of
    slots); the fixed ones are always created. Idempotent.
    """
    device = torch.device(device)
    for value in (*_FIXED_VALUES, *values):
        constant(device, value)


def constant(device: torch.device, value: int) -> torch.Tensor:
    """The cached 0-d int64 tensor holding ``value`` on ``device``."""
    key = (device, int(value))
    cached = _constants.get(key)
    if cached is not None:
        return cached
    with _lock:
        cached = _constants.get(key)
        if cached is None:
            if _capturing(device):
                raise NpuCaptureError(
                    f"eplb_graph routing constant {value} for {device} was not prepared before"
                    " graph capture; call eplb_graph.ops.npu_routing.prepare() or run the op"
                    " once eagerly first"
                )
            cached = torch.tensor(value, dtype=torch.int64, device=device)
            _constants[key] = cached
    return cached


def replica_hash_npu(rows: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``((rows + offset) * 2654435769) mod 2**32`` with no shift and no host scalar.

    ``x = (rows + (offset mod 2**32)) mod 2**32``, ``low = x mod 2**16``; then
    ``x * G == low * G + (x - low) * G`` and ``((x - low) * G) mod 2**32 ==
    ((x - low) * (G mod 2**16)) mod 2**32`` because ``x - low`` is a multiple of 2**16. Largest
    intermediate: ``low * G < 2**48``: no int64 overflow for any offset.
    """
    c = _Constants(rows.device)
    x = torch.bitwise_and(rows + torch.bitwise_and(offset, c.low32), c.low32)
    low = torch.bitwise_and(x, c.low16)
    product = low * c.golden + (x - low) * c.golden_low16
    return torch.bitwise_and(product, c.low32)


class _Constants:
    """Named views of the cached constants of one device (attribute access, no new tensors)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.zero = constant(device, 0)
        self.one = constant(device, 1)
        self.minus_one = constant(device, -1)
        self.low16 = constant(device, _LOW16)
        self.low32 = constant(device, _LOW32)
        self.golden = constant(device, GOLDEN_HASH)
        self.golden_low16 = constant(device, GOLDEN_LOW16)
        self.int32_max = constant(device, _INT32_MAX)

    def of(self, value: int) -> torch.Tensor:
        return constant(self.device, value)


def _usable(entry: torch.Tensor, c: _Constants, table_dtype, out_dtype) -> torch.Tensor:
    """``0 <= entry <= max(out_dtype)`` (reference._usable_slot, against device constants)."""
    usable = torch.ge(entry, c.zero)
    if torch.iinfo(table_dtype).max > torch.iinfo(out_dtype).max:
        usable = torch.bitwise_and(usable, torch.le(entry, c.int32_max))
    return usable


def _as_int64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 else t.to(torch.int64)


def _map(topk_ids, log2phy, replica_count, offset) -> torch.Tensor:
    num_rows = topk_ids.shape[0]
    num_experts, width = log2phy.shape
    c = _Constants(topk_ids.device)
    ids = _as_int64(topk_ids)  # [T, K]; every later tensor is [T, K] or broadcasts to it
    valid = torch.bitwise_and(torch.ge(ids, c.zero), torch.lt(ids, c.of(num_experts)))
    safe_ids = torch.where(valid, ids, c.zero)
    count = _as_int64(replica_count).index_select(0, safe_ids.reshape(-1)).reshape(safe_ids.shape)
    count = torch.maximum(count, c.one)
    rows = torch.arange(num_rows, dtype=torch.int64, device=topk_ids.device)
    row_hash = replica_hash_npu(rows, offset).unsqueeze(1)  # [T, 1], broadcast by remainder
    replica = torch.minimum(torch.remainder(row_hash, count), c.of(width - 1))
    table = _as_int64(log2phy).reshape(-1)
    row_start = safe_ids * c.of(width)
    physical = table.index_select(0, (row_start + replica).reshape(-1)).reshape(ids.shape)
    first = table.index_select(0, row_start.reshape(-1)).reshape(ids.shape)
    physical = torch.where(_usable(physical, c, log2phy.dtype, topk_ids.dtype), physical, first)
    keep = torch.bitwise_and(valid, _usable(physical, c, log2phy.dtype, topk_ids.dtype))
    physical = torch.where(keep, physical, c.minus_one)
    return physical if topk_ids.dtype == torch.int64 else physical.to(topk_ids.dtype)


def _record(load, physical_ids, num_valid_tokens, record_enabled) -> None:
    num_rows = physical_ids.shape[0]
    c = _Constants(load.device)
    rows = torch.arange(num_rows, dtype=torch.int64, device=load.device)
    row_counts = torch.bitwise_and(torch.lt(rows, num_valid_tokens), record_enabled)
    ids = _as_int64(physical_ids)
    in_range = torch.bitwise_and(torch.ge(ids, c.zero), torch.lt(ids, c.of(load.shape[0])))
    counted = torch.bitwise_and(row_counts.unsqueeze(1), in_range)
    safe_ids = torch.where(counted, ids, c.zero).reshape(-1)
    load.scatter_add_(0, safe_ids, counted.reshape(-1).to(load.dtype))


map_to_physical_npu = checked_kernel(
    "map_to_physical",
    check_map_args,
    _map,
    __name__,
    "map_to_physical_npu",
    """``map_to_physical`` for PrivateUse1: same result as the reference, capturable.""",
)
record_load_npu = checked_kernel(
    "record_load",
    check_record_args,
    _record,
    __name__,
    "record_load_npu",
    """``record_load`` for PrivateUse1 (in place on ``load``).""",
)
map_and_record_npu = checked_kernel(
    "map_and_record",
    check_map_and_record_args,
    map_then_record(_map, _record),
    __name__,
    "map_and_record_npu",
    """``map_and_record`` for PrivateUse1: every input checked before anything runs.""",
)


#: Every aten op the kernels above call, for the capture audit (docs/ascend.md lists each one's
#: op-plugin file and aclnn kernel). ``tests/test_npu_routing.py`` checks this list is complete.
ATEN_OPS = (
    "aten._to_copy.default",
    "aten.arange.default",
    "aten.add.Tensor",
    "aten.bitwise_and.Tensor",
    "aten.ge.Tensor",
    "aten.index_select.default",
    "aten.le.Tensor",
    "aten.lt.Tensor",
    "aten.maximum.default",
    "aten.minimum.default",
    "aten.mul.Tensor",
    "aten.remainder.Tensor",
    "aten.scatter_add_.default",
    "aten.sub.Tensor",
    "aten.where.self",
)
#: Views: metadata only, no device kernel.
VIEW_OPS = ("aten.unsqueeze.default", "aten.view.default")
