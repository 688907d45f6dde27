"""Metadata-only argument checks shared by the fake kernels and the reference kernels.

Why shared: the fake (meta) kernel is what torch.compile and opcheck see, the reference kernel is
what eager runs when no native kernel exists. Both must reject the same inputs with the same
message, and neither may read tensor *data* (that would be a host sync on a device), so every
check here looks only at ranks, shapes, strides, dtypes, devices and storages. The native CPU
kernel (``custom_ops/csrc/eplb_graph_cpu.cpp``) repeats these checks in the same order with the
same messages, so every kernel gives the same error for the same input.

What the checks cannot see (table *values*) has a defined result instead of an error, the same
in every kernel: see :func:`eplb_graph.ops.map_to_physical`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _check(cond: bool, message: str | Callable[[], str]) -> None:
    """``torch._check`` (a symbolic condition under fake tensors is deferred, not evaluated).

    Costs almost nothing when the check passes, because a GPU's eager path pays it per call:
    a message built from values is passed as a ``lambda`` (formatting every message took most
    of the 40 us these checks cost per ``map_and_record`` call), and a plain ``True`` returns
    before ``torch._check`` (0.7 us per call).
    """
    if cond is True:
        return
    torch._check(cond, message if callable(message) else lambda: message)


def check_map_args(
    topk_ids: torch.Tensor,
    log2phy: torch.Tensor,
    replica_count: torch.Tensor,
    offset: torch.Tensor,
) -> None:
    """Validate ``map_to_physical`` inputs (ids [T, K], log2phy [N, R], count [N])."""
    _check_map_tensors(topk_ids, log2phy, replica_count, offset)
    _check_same_device(
        "map_to_physical",
        topk_ids=topk_ids,
        log2phy=log2phy,
        replica_count=replica_count,
        offset=offset,
    )


def check_record_args(
    load: torch.Tensor,
    physical_ids: torch.Tensor,
    num_valid_tokens: torch.Tensor,
    record_enabled: torch.Tensor,
) -> None:
    """Validate the inputs of ``record_load`` (shapes: load [P], physical_ids [T, K], flags 0-d)."""
    _check_load(load)
    _check(
        physical_ids.dim() == 2,
        lambda: f"physical_ids should be a 2d tensor [T, K], got {physical_ids.dim()}D",
    )
    _check(
        physical_ids.dtype in INDEX_DTYPES,
        lambda: f"physical_ids should be int32 or int64, got {physical_ids.dtype}",
    )
    _check_step_flags(num_valid_tokens, record_enabled)
    read_only = {
        "physical_ids": physical_ids,
        "num_valid_tokens": num_valid_tokens,
        "record_enabled": record_enabled,
    }
    _check_same_device("record_load", load=load, **read_only)
    _check_load_is_private(load, read_only)


def check_map_and_record_args(
    topk_ids: torch.Tensor,
    log2phy: torch.Tensor,
    replica_count: torch.Tensor,
    offset: torch.Tensor,
    load: torch.Tensor,
    num_valid_tokens: torch.Tensor,
    record_enabled: torch.Tensor,
) -> None:
    """Validate every input of ``map_and_record`` before anything is computed or written."""
    _check_map_tensors(topk_ids, log2phy, replica_count, offset)
    _check_load(load)
    _check_step_flags(num_valid_tokens, record_enabled)
    _check_same_device(
        "map_and_record",
        topk_ids=topk_ids,
        log2phy=log2phy,
        replica_count=replica_count,
        offset=offset,
        load=load,
        num_valid_tokens=num_valid_tokens,
        record_enabled=record_enabled,
    )
    _check_load_is_private(
        load,
        {
            "topk_ids": topk_ids,
            "log2phy": log2phy,
            "replica_count": replica_count,
            "offset": offset,
            "num_valid_tokens": num_valid_tokens,
            "record_enabled": record_enabled,
        },
    )


def _check_map_tensors(
    topk_ids: torch.Tensor,
    log2phy: torch.Tensor,
    replica_count: torch.Tensor,
    offset: torch.Tensor,
) -> None:
    _check(
        topk_ids.dim() == 2, lambda: f"topk_ids should be a 2d tensor [T, K], got {topk_ids.dim()}D"
    )
    _check(
        topk_ids.dtype in INDEX_DTYPES,
        lambda: f"topk_ids should be int32 or int64, got {topk_ids.dtype}",
    )
    _check(
        log2phy.dim() == 2, lambda: f"log2phy should be a 2d tensor [N, R], got {log2phy.dim()}D"
    )
    _check(
        log2phy.dtype in INDEX_DTYPES,
        lambda: f"log2phy should be int32 or int64, got {log2phy.dtype}",
    )
    _check(
        log2phy.shape[0] >= 1 and log2phy.shape[1] >= 1,
        lambda: (
            "log2phy should have at least one expert and one replica column, "
            f"got {list(log2phy.shape)}"
        ),
    )
    _check(
        replica_count.dim() == 1,
        lambda: f"replica_count should be a 1d tensor [N], got {replica_count.dim()}D",
    )
    _check(
        replica_count.dtype in INDEX_DTYPES,
        lambda: f"replica_count should be int32 or int64, got {replica_count.dtype}",
    )
    _check(
        replica_count.shape[0] == log2phy.shape[0],
        lambda: (
            f"replica_count has {replica_count.shape[0]} experts but log2phy has {log2phy.shape[0]}"
        ),
    )
    _check(offset.dim() == 0, lambda: f"offset should be a 0-d tensor, got {offset.dim()}D")
    _check(offset.dtype == torch.int64, lambda: f"offset should be int64, got {offset.dtype}")


def _check_load(load: torch.Tensor) -> None:
    """``load`` is a counter per slot: at least one slot, and one memory cell per slot.

    A stride-0 view (``expand``) would make every slot's count land in one cell, so the counts
    would be silently wrong; ATen's in-place ops refuse such a target for the same reason.
    """
    _check(load.dim() == 1, lambda: f"load should be a 1d tensor [P], got {load.dim()}D")
    _check(load.dtype in INDEX_DTYPES, lambda: f"load should be int32 or int64, got {load.dtype}")
    _check(load.shape[0] >= 1, "load should have at least one slot, got 0")
    _check(
        load.shape[0] == 1 or load.stride(0) != 0,
        "load has several slots in one memory cell (stride 0, e.g. from expand()); "
        "pass a tensor with one element per slot (clone() it)",
    )


def _check_step_flags(num_valid_tokens: torch.Tensor, record_enabled: torch.Tensor) -> None:
    _check(
        num_valid_tokens.dim() == 0,
        lambda: f"num_valid_tokens should be a 0-d tensor, got {num_valid_tokens.dim()}D",
    )
    _check(
        num_valid_tokens.dtype in _INTEGER_DTYPES,
        lambda: f"num_valid_tokens should be an integer tensor, got {num_valid_tokens.dtype}",
    )
    _check(
        record_enabled.dim() == 0,
        lambda: f"record_enabled should be a 0-d tensor, got {record_enabled.dim()}D",
    )
    _check(
        record_enabled.dtype == torch.bool,
        lambda: f"record_enabled should be a bool tensor, got {record_enabled.dtype}",
    )


def _check_same_device(op: str, **tensors: torch.Tensor) -> None:
    """All ``tensors`` on the first one's device; the message names the argument that is not."""
    (first_name, first_tensor), *rest = tensors.items()
    first = first_tensor.device
    for name, tensor in rest:
        _check(
            tensor.device == first,
            lambda name=name, tensor=tensor: (
                f"{op}: all tensors must be on one device, got {first} and {tensor.device} "
                f"({name} is on {tensor.device}, {first_name} on {first})"
            ),
        )


def _check_load_is_private(load: torch.Tensor, read_only: dict[str, torch.Tensor]) -> None:
    """``load`` shares no memory with an input the op reads.

    The schema promises that only ``load`` is written; were it to overlap an input, the native
    kernel (which counts while it reads, row by row) and the reference (which reads everything
    first) would see different inputs and give different answers.
    """
    for name, tensor in read_only.items():
        _check(
            not _overlaps(load, tensor),
            lambda name=name: (
                f"load shares memory with {name}; the op writes load while it reads {name}, "
                f"so give load its own storage (clone() it)"
            ),
        )


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` are views of one storage whose byte ranges intersect.

    Only metadata is read (storage identity, offsets, sizes, strides), so this works on fake
    tensors. Ranges are the bounding byte spans of each view, which may call two interleaved
    views overlapping; the ops never need such inputs.
    """
    if not torch._C._is_alias_of(a, b):
        return False
    span_a, span_b = _byte_span(a), _byte_span(b)
    if span_a is None or span_b is None:
        return False
    return span_a[0] < span_b[1] and span_b[0] < span_a[1]


def _byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """``[first byte, past the last byte)`` of ``t`` within its storage; None when empty."""
    if t.numel() == 0:
        return None
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    last = t.storage_offset() + extent
    return t.storage_offset() * t.element_size(), (last + 1) * t.element_size()


# -- expert compute (local_experts, local_experts_w8a8) -------------------------------------------

HIDDEN_DTYPES = (torch.float32, torch.bfloat16)


def check_local_experts_args(
    hidden: torch.Tensor,
    slots: torch.Tensor,
    topk_weights: torch.Tensor,
    slot_to_local: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    stats: torch.Tensor,
    num_valid_tokens: torch.Tensor,
) -> None:
    """Validate ``local_experts`` inputs: hidden [T, H], slots/weights [T, K], w13 [E, 2I, H],
    w2 [E, H, I] in hidden's dtype, stats [2] int64 (written), num_valid_tokens 0-d integer."""
    op = "local_experts"
    _check_expert_routing(op, hidden, slots, topk_weights, slot_to_local)
    _check(
        w13.dtype == hidden.dtype,
        lambda: f"{op}: w13 should have hidden's dtype {hidden.dtype}, got {w13.dtype}",
    )
    _check(
        w2.dtype == hidden.dtype,
        lambda: f"{op}: w2 should have hidden's dtype {hidden.dtype}, got {w2.dtype}",
    )
    _check_expert_weights(op, hidden, w13, w2)
    _check_expert_stats(op, stats, num_valid_tokens)
    tensors = {
        "hidden": hidden,
        "slots": slots,
        "topk_weights": topk_weights,
        "slot_to_local": slot_to_local,
        "w13": w13,
        "w2": w2,
        "num_valid_tokens": num_valid_tokens,
    }
    _check_same_device(op, stats=stats, **tensors)
    _check_stats_is_private(stats, tensors)


def check_local_experts_w8a8_args(
    hidden: torch.Tensor,
    slots: torch.Tensor,
    topk_weights: torch.Tensor,
    slot_to_local: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    stats: torch.Tensor,
    num_valid_tokens: torch.Tensor,
) -> None:
    """Validate ``local_experts_w8a8`` inputs: as :func:`check_local_experts_args`, with int8
    weights and float32 per-output-channel scales w13_scale [E, 2I], w2_scale [E, H]."""
    op = "local_experts_w8a8"
    _check_expert_routing(op, hidden, slots, topk_weights, slot_to_local)
    _check(w13.dtype == torch.int8, lambda: f"{op}: w13 should be int8, got {w13.dtype}")
    _check(w2.dtype == torch.int8, lambda: f"{op}: w2 should be int8, got {w2.dtype}")
    _check_expert_weights(op, hidden, w13, w2)
    for name, scale, rows in (
        ("w13_scale", w13_scale, w13.shape[1]),
        ("w2_scale", w2_scale, w2.shape[1]),
    ):
        _check(
            scale.dtype == torch.float32,
            lambda name=name, scale=scale: f"{op}: {name} should be float32, got {scale.dtype}",
        )
        expected = [w13.shape[0], rows]
        _check(
            list(scale.shape) == expected,
            lambda name=name, scale=scale, expected=expected: (
                f"{op}: {name} should have shape {expected}, got {list(scale.shape)}"
            ),
        )
    _check_expert_stats(op, stats, num_valid_tokens)
    tensors = {
        "hidden": hidden,
        "slots": slots,
        "topk_weights": topk_weights,
        "slot_to_local": slot_to_local,
        "w13": w13,
        "w2": w2,
        "w13_scale": w13_scale,
        "w2_scale": w2_scale,
        "num_valid_tokens": num_valid_tokens,
    }
    _check_same_device(op, stats=stats, **tensors)
    _check_stats_is_private(stats, tensors)


def _check_expert_routing(
    op: str,
    hidden: torch.Tensor,
    slots: torch.Tensor,
    topk_weights: torch.Tensor,
    slot_to_local: torch.Tensor,
) -> None:
    _check(
        hidden.dim() == 2, lambda: f"{op}: hidden should be a 2d tensor [T, H], got {hidden.dim()}D"
    )
    _check(
        hidden.dtype in HIDDEN_DTYPES,
        lambda: f"{op}: hidden should be float32 or bfloat16, got {hidden.dtype}",
    )
    _check(
        slots.dim() == 2, lambda: f"{op}: slots should be a 2d tensor [T, K], got {slots.dim()}D"
    )
    _check(
        slots.dtype in INDEX_DTYPES,
        lambda: f"{op}: slots should be int32 or int64, got {slots.dtype}",
    )
    _check(
        slots.shape[0] == hidden.shape[0],
        lambda: f"{op}: slots has {slots.shape[0]} rows but hidden has {hidden.shape[0]}",
    )
    _check(
        list(topk_weights.shape) == list(slots.shape),
        lambda: (
            f"{op}: topk_weights should have slots' shape {list(slots.shape)}, "
            f"got {list(topk_weights.shape)}"
        ),
    )
    _check(
        topk_weights.dtype in (hidden.dtype, torch.float32),
        lambda: (
            f"{op}: topk_weights should be float32 or hidden's dtype {hidden.dtype}, "
            f"got {topk_weights.dtype}"
        ),
    )
    _check(
        slot_to_local.dim() == 1,
        lambda: f"{op}: slot_to_local should be a 1d tensor [P], got {slot_to_local.dim()}D",
    )
    _check(
        slot_to_local.dtype in INDEX_DTYPES,
        lambda: f"{op}: slot_to_local should be int32 or int64, got {slot_to_local.dtype}",
    )


def _check_expert_weights(
    op: str, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> None:
    _check(w13.dim() == 3, lambda: f"{op}: w13 should be a 3d tensor [E, 2I, H], got {w13.dim()}D")
    _check(w2.dim() == 3, lambda: f"{op}: w2 should be a 3d tensor [E, H, I], got {w2.dim()}D")
    _check(
        w13.shape[1] % 2 == 0,
        lambda: f"{op}: w13 should stack gate and up rows (an even dim 1), got {w13.shape[1]}",
    )
    expected = [w13.shape[0], hidden.shape[1], w13.shape[1] // 2]
    _check(
        w13.shape[2] == hidden.shape[1],
        lambda: (
            f"{op}: w13 should have shape [E, 2I, {hidden.shape[1]}] (hidden's H), "
            f"got {list(w13.shape)}"
        ),
    )
    _check(
        list(w2.shape) == expected,
        lambda: (
            f"{op}: w2 should have shape {expected} ([E, H, I] of w13 and hidden), "
            f"got {list(w2.shape)}"
        ),
    )


def _check_expert_stats(op: str, stats: torch.Tensor, num_valid_tokens: torch.Tensor) -> None:
    _check(
        stats.dim() == 1 and stats.shape[0] in (2, 3),
        lambda: (
            f"{op}: stats should be a 1d tensor [2] (rows, ns) or [3] (rows, ns, active slots), "
            f"got {list(stats.shape)}"
        ),
    )
    _check(stats.dtype == torch.int64, lambda: f"{op}: stats should be int64, got {stats.dtype}")
    _check(
        stats.stride(0) != 0, lambda: f"{op}: stats should be two memory cells, got a stride-0 view"
    )
    _check(
        num_valid_tokens.dim() == 0,
        lambda: f"{op}: num_valid_tokens should be a 0-d tensor, got {num_valid_tokens.dim()}D",
    )
    _check(
        num_valid_tokens.dtype in _INTEGER_DTYPES,
        lambda: f"{op}: num_valid_tokens should be an integer tensor, got {num_valid_tokens.dtype}",
    )


def _check_stats_is_private(stats: torch.Tensor, read_only: dict[str, torch.Tensor]) -> None:
    for name, tensor in read_only.items():
        _check(
            not _overlaps(stats, tensor),
            lambda name=name: (
                f"stats shares memory with {name}; the op writes stats while it reads {name}, "
                f"so give stats its own storage (clone() it)"
            ),
        )
