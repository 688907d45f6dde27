"""Metadata-only argument checks shared by the fake kernels and the reference kernels.

Why shared: the fake (meta) kernel is what torch.compile and opcheck see, the reference kernel is
what eager runs when no native kernel exists. Both must reject the same inputs with the same
message, and neither may read tensor *data* (that would be a host sync on a device), so every
check here looks only at ranks, shapes, strides, dtypes, devices and storages. The native CPU
kernel (``custom_ops/csrc/eplb_graph_cpu.cpp``) repeats these checks in the same order with the
same messages, so every kernel gives the same error for the same input.

Every ``check_*_args`` takes its op's tensor arguments in schema order (``signatures``), which
also names them in the device and aliasing messages, so no check re-spells an op's parameters.

What the checks cannot see (table *values*) has a defined result instead of an error, the same
in every kernel: see :func:`eplb_graph.ops.map_to_physical`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eplb_graph.ops.signatures import MAPPED, SIGNATURES

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


def check_map_args(*args: torch.Tensor) -> None:
    """Validate ``map_to_physical`` inputs (ids [T, K], log2phy [N, R], count [N])."""
    _check_map_tensors(*args)
    _check_together("map_to_physical", args)


def check_record_args(*args: torch.Tensor) -> None:
    """Validate the inputs of ``record_load`` (shapes: load [P], physical_ids [T, K], flags 0-d)."""
    load, physical_ids, num_valid_tokens, record_enabled = args
    _check_load(load)
    _check_kind("physical_ids", physical_ids, 2, "[T, K]")
    _check_step_flags("", num_valid_tokens, record_enabled)
    _check_together("record_load", args)


def check_map_and_record_args(*args: torch.Tensor) -> None:
    """Validate every input of ``map_and_record`` before anything is computed or written."""
    _check_map_tensors(*args[:MAPPED])
    _check_load(args[MAPPED])
    _check_step_flags("", *args[MAPPED + 1 :])
    _check_together("map_and_record", args)


def _rank_message(label: str, tensor: torch.Tensor, dims: int, shape: str) -> str:
    rank = "a 0-d tensor" if dims == 0 else f"a {dims}d tensor {shape}"
    return f"{label} should be {rank}, got {tensor.dim()}D"


def _check_rank(label: str, tensor: torch.Tensor, dims: int, shape: str = "") -> None:
    """``tensor`` has ``dims`` dimensions; ``label`` names it (with the op, where messages do)."""
    _check(tensor.dim() == dims, lambda: _rank_message(label, tensor, dims, shape))


def _check_dtype(
    label: str, tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...], kind: str
) -> None:
    _check(tensor.dtype in dtypes, lambda: f"{label} should be {kind}, got {tensor.dtype}")


def _check_kind(
    label: str,
    tensor: torch.Tensor,
    dims: int,
    shape: str = "",
    dtypes: tuple[torch.dtype, ...] = INDEX_DTYPES,
    kind: str = "int32 or int64",
) -> None:
    """Rank then dtype (an index tensor unless told): the order every kernel checks them in.

    Both checks are inline rather than calls of the two above: the routing ops' eager path on a
    GPU pays this function about ten times per call.
    """
    _check(tensor.dim() == dims, lambda: _rank_message(label, tensor, dims, shape))
    _check(tensor.dtype in dtypes, lambda: f"{label} should be {kind}, got {tensor.dtype}")


def _check_map_tensors(
    topk_ids: torch.Tensor,
    log2phy: torch.Tensor,
    replica_count: torch.Tensor,
    offset: torch.Tensor,
) -> None:
    _check_kind("topk_ids", topk_ids, 2, "[T, K]")
    _check_kind("log2phy", log2phy, 2, "[N, R]")
    _check(
        log2phy.shape[0] >= 1 and log2phy.shape[1] >= 1,
        lambda: (
            "log2phy should have at least one expert and one replica column, "
            f"got {list(log2phy.shape)}"
        ),
    )
    _check_kind("replica_count", replica_count, 1, "[N]")
    _check(
        replica_count.shape[0] == log2phy.shape[0],
        lambda: (
            f"replica_count has {replica_count.shape[0]} experts but log2phy has {log2phy.shape[0]}"
        ),
    )
    _check_kind("offset", offset, 0, dtypes=(torch.int64,), kind="int64")


def _check_load(load: torch.Tensor) -> None:
    """``load`` is a counter per slot: at least one slot, and one memory cell per slot.

    A stride-0 view (``expand``) would make every slot's count land in one cell, so the counts
    would be silently wrong; ATen's in-place ops refuse such a target for the same reason.
    """
    _check_kind("load", load, 1, "[P]")
    _check(load.shape[0] >= 1, "load should have at least one slot, got 0")
    _check(
        load.shape[0] == 1 or load.stride(0) != 0,
        "load has several slots in one memory cell (stride 0, e.g. from expand()); "
        "pass a tensor with one element per slot (clone() it)",
    )


def _check_step_flags(
    prefix: str, num_valid_tokens: torch.Tensor, record_enabled: torch.Tensor | None = None
) -> None:
    """The 0-d step tensors; ``prefix`` is ``"op: "`` where the op's messages name the op."""
    _check_kind(
        f"{prefix}num_valid_tokens",
        num_valid_tokens,
        0,
        dtypes=_INTEGER_DTYPES,
        kind="an integer tensor",
    )
    if record_enabled is not None:
        _check_kind(
            f"{prefix}record_enabled",
            record_enabled,
            0,
            dtypes=(torch.bool,),
            kind="a bool tensor",
        )


def _check_together(op: str, args: tuple[torch.Tensor, ...], written_first: bool = False) -> None:
    """All of ``op``'s tensors on one device, and the one it writes sharing no memory with one it
    reads; the schema names them. The first tensor (or, ``written_first``, the written one) sets
    the device; the others are checked in schema order, as every kernel does."""
    signature = SIGNATURES[op]
    names, written = signature.tensors, signature.written
    first = written if written_first and written is not None else 0
    device = args[first].device
    for index, tensor in enumerate(args):
        if index != first:
            _check(
                tensor.device == device,
                lambda index=index, tensor=tensor: (
                    f"{op}: all tensors must be on one device, got {device} and {tensor.device} "
                    f"({names[index]} is on {tensor.device}, {names[first]} on {device})"
                ),
            )
    if written is not None:
        _check_is_private(names, args, written)


def _check_is_private(names: tuple[str, ...], args: tuple[torch.Tensor, ...], written: int) -> None:
    """The tensor ``args[written]`` the op writes shares no memory with an input it reads.

    The schema promises that only that tensor is written; were it to overlap an input, the native
    kernel (which writes while it reads, row by row) and the reference (which reads everything
    first) would see different inputs and give different answers.
    """
    name, target = names[written], args[written]
    for index, tensor in enumerate(args):
        if index != written:
            _check(
                not _overlaps(target, tensor),
                lambda other=names[index]: (
                    f"{name} shares memory with {other}; the op writes {name} while it reads "
                    f"{other}, so give {name} its own storage (clone() it)"
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


def check_local_experts_args(*args: torch.Tensor) -> None:
    """Validate ``local_experts`` inputs: hidden [T, H], slots/weights [T, K], w13 [E, 2I, H],
    w2 [E, H, I] in hidden's dtype, stats [2] int64 (written), num_valid_tokens 0-d integer."""
    _check_experts("local_experts", args)


def check_local_experts_w8a8_args(*args: torch.Tensor) -> None:
    """Validate ``local_experts_w8a8`` inputs: as :func:`check_local_experts_args`, with int8
    weights and float32 per-output-channel scales w13_scale [E, 2I], w2_scale [E, H]."""
    _check_experts("local_experts_w8a8", args)


def _check_experts(op: str, args: tuple[torch.Tensor, ...]) -> None:
    """The checks of both expert ops, in one order; an op with scales has int8 weights."""
    named = dict(zip(SIGNATURES[op].tensors, args, strict=True))
    hidden, w13, w2 = named["hidden"], named["w13"], named["w2"]
    _check_expert_routing(op, hidden, named["slots"], named["topk_weights"], named["slot_to_local"])
    quantized = "w13_scale" in named
    for name, weight in (("w13", w13), ("w2", w2)):
        if quantized:
            _check_dtype(f"{op}: {name}", weight, (torch.int8,), "int8")
        else:
            _check(
                weight.dtype == hidden.dtype,
                lambda name=name, weight=weight: (
                    f"{op}: {name} should have hidden's dtype {hidden.dtype}, got {weight.dtype}"
                ),
            )
    _check_expert_weights(op, hidden, w13, w2)
    if quantized:
        _check_scales(op, w13, w2, named["w13_scale"], named["w2_scale"])
    _check_expert_stats(op, named["stats"], named["num_valid_tokens"])
    _check_together(op, args, written_first=True)


def _check_scales(
    op: str, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor
) -> None:
    """float32 per-output-channel scales: ``[E, 2I]`` for w13, ``[E, H]`` for w2."""
    for name, scale, rows in (
        ("w13_scale", w13_scale, w13.shape[1]),
        ("w2_scale", w2_scale, w2.shape[1]),
    ):
        _check_dtype(f"{op}: {name}", scale, (torch.float32,), "float32")
        expected = [w13.shape[0], rows]
        _check(
            list(scale.shape) == expected,
            lambda name=name, scale=scale, expected=expected: (
                f"{op}: {name} should have shape {expected}, got {list(scale.shape)}"
            ),
        )


def _check_expert_routing(
    op: str,
    hidden: torch.Tensor,
    slots: torch.Tensor,
    topk_weights: torch.Tensor,
    slot_to_local: torch.Tensor,
) -> None:
    _check_kind(f"{op}: hidden", hidden, 2, "[T, H]", HIDDEN_DTYPES, "float32 or bfloat16")
    _check_kind(f"{op}: slots", slots, 2, "[T, K]")
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
    _check_kind(f"{op}: slot_to_local", slot_to_local, 1, "[P]")


def _check_expert_weights(
    op: str, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> None:
    _check_rank(f"{op}: w13", w13, 3, "[E, 2I, H]")
    _check_rank(f"{op}: w2", w2, 3, "[E, H, I]")
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
    _check_dtype(f"{op}: stats", stats, (torch.int64,), "int64")
    _check(
        stats.stride(0) != 0, lambda: f"{op}: stats should be two memory cells, got a stride-0 view"
    )
    _check_step_flags(f"{op}: ", num_valid_tokens)
