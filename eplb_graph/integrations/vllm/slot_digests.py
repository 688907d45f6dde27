"""Proof that moved experts are whole: per-slot digests of what the kernel reads, and their check.

A rearrangement is right only if, afterwards, every local slot holds *exactly* the bytes the
kernel would read for the expert the placement says the slot holds: packed weights, their
compensation bytes, scales, biases, all of them. Tokens alone cannot show it (a stale scale on
a cold expert may change no greedy token), so with ``additional_config.eplb_graph.
weight_digests`` each rank hashes, slot by slot, the live tensors its kernel reads (taken from
the layer and the kernel, not from the weight view, so a view that forgot a tensor is caught),
once when EPLB attaches and again whenever the committed placement changes, and writes the
records into its metrics file (key ``weight_digests``).

:func:`check_slot_digests` judges the files of all ranks together: the attach records give the
digest of every expert (each expert is on some rank at load time, where vLLM packed it from the
checkpoint), and every later record must show, for every local slot, the digest of the expert
its placement names. It is a debugging aid: hashing every expert costs a pass over the weights.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch

RECORDS_KEPT = 64
"""Records after the one at attach that a rank keeps (the newest)."""


def kernel_tensors(experts: Any, kernel: Any) -> dict[str, torch.Tensor]:
    """Every per-expert tensor the layer's expert kernel reads, by name (``[slots, ...]``)."""
    tensors = {"w13": experts.w13_weight.data, "w2": experts.w2_weight.data}
    for name, attribute in (
        ("w13_scale", "w1_scale"),
        ("w2_scale", "w2_scale"),
        ("w13_bias", "w1_bias"),
        ("w2_bias", "w2_bias"),
        ("w13_zp", "w1_zp"),
        ("w2_zp", "w2_zp"),
    ):
        value = getattr(kernel, attribute, None)
        if isinstance(value, torch.Tensor):
            tensors[name] = value.data
    return tensors


def slot_digests(layers: Sequence[Mapping[str, torch.Tensor]]) -> list[list[str]]:
    """``[layer][slot]``: a digest of every tensor's bytes for that slot, in name order."""
    digests = []
    for tensors in layers:
        num_slots = next(iter(tensors.values())).shape[0]
        row = []
        for slot in range(num_slots):
            hasher = hashlib.blake2b(digest_size=8)
            for name in sorted(tensors):
                part = tensors[name][slot].contiguous()
                hasher.update(name.encode())
                hasher.update(part.view(-1).view(torch.uint8).numpy().tobytes())
            row.append(hasher.hexdigest())
        digests.append(row)
    return digests


class DigestLog:
    """One rank's records: ``{"version", "phy2log", "slots"}`` at attach and after each change."""

    def __init__(self, layers: Sequence[Mapping[str, torch.Tensor]]) -> None:
        self.layers = [dict(tensors) for tensors in layers]
        self.initial: dict[str, Any] | None = None
        self.records: deque[dict[str, Any]] = deque(maxlen=RECORDS_KEPT)
        self._version: int | None = None
        self._lock = threading.Lock()  # the metrics writer reads from its own thread

    def record(self, version: int, phy2log: torch.Tensor) -> bool:
        """Hash the slots if the committed placement changed since the last record."""
        if version == self._version:
            return False
        entry = {
            "version": int(version),
            "phy2log": phy2log.to(torch.int64).tolist(),
            "slots": slot_digests(self.layers),
        }
        with self._lock:
            if self.initial is None:
                self.initial = entry
            else:
                self.records.append(entry)
        self._version = version
        return True

    def document(self) -> dict[str, Any]:
        with self._lock:
            return {"initial": self.initial, "records": list(self.records)}


def check_slot_digests(documents: Sequence[Mapping[str, Any]]) -> tuple[int, list[str]]:
    """``(records checked, problems)`` over every rank's metrics document.

    Expected digests come from the attach records (expert -> digest; two slots of one expert
    must agree); every later record of every rank must match them slot by slot, and ranks must
    agree on the placement of each version.
    """
    problems: list[str] = []
    reference: dict[tuple[int, int], str] = {}
    logs = []
    for document in documents:
        rank, log = document["rank"], document.get("weight_digests")
        if not log or not log.get("initial"):
            problems.append(f"rank {rank}: no weight digests recorded")
            continue
        logs.append((rank, log))
        _expected(rank, log["initial"], reference, problems)
    placements: dict[int, list] = {}
    checked = 0
    for rank, log in logs:
        for entry in log["records"]:
            checked += 1
            seen = placements.setdefault(entry["version"], entry["phy2log"])
            if seen != entry["phy2log"]:
                problems.append(f"rank {rank}: version {entry['version']} has another placement")
            for layer, slot, expert, digest in _slots(rank, entry):
                if reference.get((layer, expert)) != digest:
                    problems.append(
                        f"rank {rank} version {entry['version']} layer {layer} slot {slot}: "
                        f"holds {digest}, expert {expert} is {reference.get((layer, expert))}"
                    )
    return checked, problems


def _slots(rank: int, entry: Mapping[str, Any]):
    """``(layer, global slot, expert the placement names, digest)`` of a rank's local slots."""
    for layer, row in enumerate(entry["slots"]):
        for local, digest in enumerate(row):
            slot = rank * len(row) + local
            yield layer, slot, entry["phy2log"][layer][slot], digest


def _expected(rank: int, initial, reference: dict, problems: list[str]) -> None:
    for layer, slot, expert, digest in _slots(rank, initial):
        known = reference.setdefault((layer, expert), digest)
        if known != digest:
            problems.append(
                f"rank {rank} at attach: layer {layer} slot {slot} holds expert {expert} as "
                f"{digest}, another slot as {known}"
            )
