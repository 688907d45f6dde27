"""Metadata-only argument checks shared by the fake kernels and the reference kernels.

Why shared: the fake (meta) kernel is what torch.compile and opcheck see, the reference kernel is
what eager runs when no native kernel exists. Both must reject the same inputs with the same
message, and neither may read tensor *data* (that would be a host sync on a device), so every
check here looks only at ranks, dtypes and devices.
"""

from __future__ import annotations

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _check(cond: bool, message: str) -> None:
    torch._check(cond, lambda: message)


def check_map_args(
    topk_ids: torch.Tensor,
    log2phy: torch.Tensor,
    replica_count: torch.Tensor,
    offset: torch.Tensor,
) -> None:
    """Validate ``map_to_physical`` inputs (ids [T, K], log2phy [N, R], count [N])."""
    _check(topk_ids.dim() == 2, f"topk_ids should be a 2d tensor [T, K], got {topk_ids.dim()}D")
    _check(
        topk_ids.dtype in INDEX_DTYPES,
        f"topk_ids should be int32 or int64, got {topk_ids.dtype}",
    )
    _check(log2phy.dim() == 2, f"log2phy should be a 2d tensor [N, R], got {log2phy.dim()}D")
    _check(log2phy.dtype in INDEX_DTYPES, f"log2phy should be int32 or int64, got {log2phy.dtype}")
    _check(
        log2phy.shape[0] >= 1 and log2phy.shape[1] >= 1,
        "log2phy should have at least one expert and one replica column, "
        f"got {tuple(log2phy.shape)}",
    )
    _check(
        replica_count.dim() == 1,
        f"replica_count should be a 1d tensor [N], got {replica_count.dim()}D",
    )
    _check(
        replica_count.dtype in INDEX_DTYPES,
        f"replica_count should be int32 or int64, got {replica_count.dtype}",
    )
    _check(
        replica_count.shape[0] == log2phy.shape[0],
        f"replica_count has {replica_count.shape[0]} experts but log2phy has {log2phy.shape[0]}",
    )
    _check(offset.dim() == 0, f"offset should be a 0-d tensor, got {offset.dim()}D")
    _check(offset.dtype == torch.int64, f"offset should be int64, got {offset.dtype}")
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
    _check(load.dim() == 1, f"load should be a 1d tensor [P], got {load.dim()}D")
    _check(load.dtype in INDEX_DTYPES, f"load should be int32 or int64, got {load.dtype}")
    _check(
        physical_ids.dim() == 2,
        f"physical_ids should be a 2d tensor [T, K], got {physical_ids.dim()}D",
    )
    _check(
        physical_ids.dtype in INDEX_DTYPES,
        f"physical_ids should be int32 or int64, got {physical_ids.dtype}",
    )
    _check(
        num_valid_tokens.dim() == 0,
        f"num_valid_tokens should be a 0-d tensor, got {num_valid_tokens.dim()}D",
    )
    _check(
        num_valid_tokens.dtype in _INTEGER_DTYPES,
        f"num_valid_tokens should be an integer tensor, got {num_valid_tokens.dtype}",
    )
    _check(
        record_enabled.dim() == 0,
        f"record_enabled should be a 0-d tensor, got {record_enabled.dim()}D",
    )
    _check(
        record_enabled.dtype == torch.bool,
        f"record_enabled should be a bool tensor, got {record_enabled.dtype}",
    )
    _check_same_device(
        "record_load",
        load=load,
        physical_ids=physical_ids,
        num_valid_tokens=num_valid_tokens,
        record_enabled=record_enabled,
    )


def _check_same_device(op: str, **tensors: torch.Tensor) -> None:
    """All ``tensors`` on the first one's device; the message names the argument that is not."""
    (first_name, first_tensor), *rest = tensors.items()
    first = first_tensor.device
    for name, tensor in rest:
        _check(
            tensor.device == first,
            f"{op}: all tensors must be on one device, got {first} and {tensor.device} "
            f"({name} is on {tensor.device}, {first_name} on {first})",
        )
