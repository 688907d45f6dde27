"""``EplbState``: the device tensors the routing op reads and writes, with stable addresses.

Every tensor here is allocated once, at its maximum size, and afterwards only written in place
(``copy_``/``fill_``/``zero_``/``add_``). Compiled graphs hold these tensors as inputs and
captured device graphs hold their addresses, so a placement change must never rebind or resize
them: that is what keeps torch.compile from recompiling and CUDA/ACL graphs from reading freed
memory (invariants 3 and 9). Each tensor is marked as a static address so cudagraph trees treat
it as a fixed input rather than copying it on every replay.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch

from eplb_graph.arguments import as_flag, as_index, as_int
from eplb_graph.errors import EplbError
from eplb_graph.ops import INDEX_DTYPES
from eplb_graph.placement import Placement
from eplb_graph.tables import (
    PlacementError,
    check_layer_index,
    check_lookup_width,
    derive_log2phy,
    replica_counts,
    validate_layer_row,
)

logger = logging.getLogger(__name__)

_LOW32 = 0xFFFFFFFF


class EplbStateError(EplbError, ValueError):
    """An argument of ``EplbState`` (construction, step inputs, a commit) is invalid; nothing
    was written."""


@dataclass(frozen=True)
class PreparedLayer:
    """One layer's validated new tables, derived on the host in the state's dtypes.

    Made only by :meth:`EplbState.prepare_layer` (off the main thread in async mode), consumed by
    :meth:`EplbState.commit_prepared_` (on it), so the expensive part of a commit happens away
    from serving and the commit itself is three in-place copies.
    """

    layer: int
    phy2log: torch.Tensor  # [P]
    log2phy: torch.Tensor  # [N, R]
    replica_count: torch.Tensor  # [N]


@dataclass(frozen=True)
class LayerTables:
    """Views of one layer's rows; pass these to ``map_and_record`` (shapes in the op docs)."""

    log2phy: torch.Tensor  # [N, R]
    replica_count: torch.Tensor  # [N]
    load: torch.Tensor  # [P]


class EplbState:
    """Device-resident EPLB state for all MoE layers of one EP rank.

    Tensors (allocated once on ``device``):
        log2phy ``[L, N, R]`` (index dtype), replica_count ``[L, N]``, phy2log ``[L, P]``,
        load ``[L, P]`` (the load pass of the current step window), record_enabled 0-d bool,
        num_valid_tokens 0-d int64, offset 0-d int64.

    Args:
        placement: initial committed placement.
        max_replicas: lookup width R, fixed for the process lifetime. Defaults to
            ``num_redundant + 1``, the most replicas any expert can have.
        device: where the tensors live.
        index_dtype: dtype of the lookup tables (int32 halves their size; int64 matches upstream).
        load_dtype: dtype of the load counters.
        rank: this process's EP rank.
        offset_seed: the replica-choice ``offset`` at step 0 (default: ``rank``). Where each rank
            routes its own tokens, different seeds make ranks start on different replicas;
            where every rank routes every token (replicated routing, e.g. vLLM's CPU expert
            parallelism), the seed must be the same on every rank (a token's replica must be).
    """

    def __init__(
        self,
        placement: Placement,
        *,
        max_replicas: int | None = None,
        device: torch.device | str = "cpu",
        index_dtype: torch.dtype = torch.int64,
        load_dtype: torch.dtype = torch.int64,
        rank: int = 0,
        offset_seed: int | None = None,
    ) -> None:
        if index_dtype not in INDEX_DTYPES:
            raise TypeError(f"index_dtype must be torch.int32 or torch.int64, got {index_dtype}")
        if load_dtype not in INDEX_DTYPES:
            raise TypeError(f"load_dtype must be torch.int32 or torch.int64, got {load_dtype}")
        if not isinstance(placement, Placement):
            raise EplbStateError(f"placement must be a Placement, got {type(placement).__name__}")
        rank = as_index("rank", rank, placement.num_ranks, error=EplbStateError)
        width = placement.num_redundant + 1
        if max_replicas is not None:
            width = as_int("max_replicas", max_replicas, minimum=1, error=EplbStateError)
        if offset_seed is not None:
            offset_seed = as_int("offset_seed", offset_seed, minimum=0, error=EplbStateError)
        log2phy_host = placement.log2phy(width)  # raises PlacementError if R is too small
        device = torch.device(device)
        num_layers, num_slots = placement.num_layers, placement.num_slots

        self.num_logical = placement.num_logical
        self.num_ranks = placement.num_ranks
        self.max_replicas = width
        self.rank = rank
        self.device = device
        self._committed = placement.phy2log.clone()  # host mirror: the committed placement
        self._version = 0
        self._snapshot: torch.Tensor | None = None
        # Tables this state's prepare_layer made: the only ones commit_prepared_ installs, so a
        # hand-built (possibly inconsistent) set of tables can never reach the lookup.
        self._issued: weakref.WeakSet[PreparedLayer] = weakref.WeakSet()

        def alloc(host: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            # copy=True: never alias the caller's tensors (a Placement is a value; commits
            # write these buffers in place).
            return host.to(device=device, dtype=dtype, copy=True).contiguous()

        self.log2phy = alloc(log2phy_host, index_dtype)
        self.replica_count = alloc(placement.replica_count(), index_dtype)
        self.phy2log = alloc(placement.phy2log, index_dtype)
        self.load = torch.zeros(num_layers, num_slots, dtype=load_dtype, device=device)
        self.record_enabled = torch.ones((), dtype=torch.bool, device=device)
        self.num_valid_tokens = torch.zeros((), dtype=torch.int64, device=device)
        seed = rank if offset_seed is None else offset_seed
        self.offset = torch.full((), seed & _LOW32, dtype=torch.int64, device=device)
        # Per layer: [(token, k) rows computed, ns spent, active slots] by this rank's expert op,
        # accumulated by the op itself (torch.ops.eplb_graph.local_experts*:
        # ``stats=expert_stats[layer]``) so a compiled graph's expert time is read host-side
        # between replays, as per-step deltas; the active slots (slots that computed a row, per
        # call) are what the expert cost model needs besides rows (control/cost_model.py).
        # Never reset inside a graph; not a routing table, so not in graph_tensors().
        self.expert_stats = torch.zeros(num_layers, 3, dtype=torch.int64, device=device)
        for tensor in (*self.graph_tensors().values(), self.expert_stats):
            torch._dynamo.mark_static_address(tensor, guard=False)

    # -- introspection -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.log2phy.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[1]

    @property
    def placement(self) -> Placement:
        """The committed placement (a value; later commits do not change it)."""
        return Placement(self._committed.clone(), self.num_logical, self.num_ranks)

    @property
    def placement_version(self) -> int:
        """Incremented by every commit; lets load windows tell placements apart cheaply."""
        return self._version

    def committed_snapshot(self) -> tuple[int, torch.Tensor]:
        """``(version, phy2log [L, P])`` of the committed placement; the tensor is never mutated
        afterwards, so holders (load-window rows) keep the placement their load was recorded
        under."""
        if self._snapshot is None:
            self._snapshot = self._committed.clone()
        return self._version, self._snapshot

    def _committed_changed(self) -> None:
        self._version += 1
        self._snapshot = None

    def graph_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor a graph may read, by name (their addresses never change)."""
        return {
            "log2phy": self.log2phy,
            "replica_count": self.replica_count,
            "phy2log": self.phy2log,
            "load": self.load,
            "record_enabled": self.record_enabled,
            "num_valid_tokens": self.num_valid_tokens,
            "offset": self.offset,
        }

    def data_ptrs(self) -> dict[str, int]:
        return {name: tensor.data_ptr() for name, tensor in self.graph_tensors().items()}

    def layer(self, layer: int) -> LayerTables:
        return LayerTables(self.log2phy[layer], self.replica_count[layer], self.load[layer])

    # -- per-step controls (host side, between replays; no host sync) --------------------------
    def set_step_inputs_(self, num_valid_tokens: int, record: bool) -> None:
        """Set the valid-token count (padding rows excluded) and the record flag in place."""
        num_valid_tokens = as_int(
            "num_valid_tokens", num_valid_tokens, minimum=0, error=EplbStateError
        )
        record = as_flag("record", record, error=EplbStateError)
        self.num_valid_tokens.fill_(num_valid_tokens)
        self.record_enabled.fill_(record)

    def advance_offset_(self, steps: int = 1) -> None:
        """Move the replica-choice offset in place (kept within 32 bits: no overflow, ever)."""
        steps = as_int("steps", steps, maximum=None, error=EplbStateError)  # modular: any int
        self.offset.add_(steps).bitwise_and_(_LOW32)

    def reset_load_(self) -> None:
        self.load.zero_()

    # -- commit --------------------------------------------------------------------------------
    def prepare_layer(self, layer: int, phy2log_row: torch.Tensor) -> PreparedLayer:
        """Validate one layer's new ``phy2log [P]`` and derive its tables on the host.

        Raises :class:`PlacementError` (naming the layer) and writes nothing on a defect.
        """
        layer = check_layer_index(layer, self.num_layers)
        row = validate_layer_row(
            phy2log_row, layer, self.num_logical, self.num_ranks, self.num_slots
        ).unsqueeze(0)
        counts = replica_counts(row, self.num_logical)
        check_lookup_width(counts, self.max_replicas, first_layer=layer)
        log2phy = derive_log2phy(row, self.num_logical, self.max_replicas)
        dtype = self.log2phy.dtype
        prepared = PreparedLayer(layer, row[0].to(dtype), log2phy[0].to(dtype), counts[0].to(dtype))
        self._issued.add(prepared)
        return prepared

    def commit_prepared_(self, layer: int, prepared: PreparedLayer) -> None:
        """Write prepared tables into the layer's rows in place (no reallocation, no loop).

        Everything is checked before the first write, so a bad argument changes nothing.
        """
        layer = check_layer_index(layer, self.num_layers)
        self._check_prepared(layer, prepared)
        # Table before count: a torn read in between sees (new row, old count); the routing op
        # falls back to replica 0 for a -1 pad, so a valid id never maps to -1 either way.
        self.log2phy[layer].copy_(prepared.log2phy, non_blocking=True)
        self.replica_count[layer].copy_(prepared.replica_count, non_blocking=True)
        self.phy2log[layer].copy_(prepared.phy2log, non_blocking=True)
        self._committed[layer].copy_(prepared.phy2log)
        self._committed_changed()

    def _check_prepared(self, layer: int, prepared: object) -> None:
        if not isinstance(prepared, PreparedLayer) or prepared not in self._issued:
            raise PlacementError(
                f"commit_prepared_ takes the PreparedLayer this state's prepare_layer made, got "
                f"{type(prepared).__name__}"
            )
        if prepared.layer != layer:
            raise PlacementError(
                f"tables prepared for layer {prepared.layer} cannot be committed to layer {layer}"
            )
        expected = {
            "phy2log": self.phy2log[layer],
            "log2phy": self.log2phy[layer],
            "replica_count": self.replica_count[layer],
        }
        for name, target in expected.items():
            tensor = getattr(prepared, name)
            if not isinstance(tensor, torch.Tensor) or tensor.shape != target.shape:
                raise PlacementError(
                    f"layer {layer}: prepared {name} must be a tensor of shape "
                    f"{tuple(target.shape)}"
                )
            if tensor.dtype != target.dtype:
                raise PlacementError(
                    f"layer {layer}: prepared {name} has dtype {tensor.dtype}, the state holds "
                    f"{target.dtype}; use prepare_layer"
                )

    def commit_layer_(self, layer: int, phy2log_row: torch.Tensor) -> None:
        """Validate, then commit one layer's placement in place (invariant 3's only writer)."""
        self.commit_prepared_(layer, self.prepare_layer(layer, phy2log_row))

    def commit_(self, placement: Placement) -> None:
        """Commit every layer of ``placement`` (validated in full before the first write)."""
        if (placement.num_logical, placement.num_ranks, placement.num_slots) != (
            self.num_logical,
            self.num_ranks,
            self.num_slots,
        ):
            raise PlacementError(
                f"placement has (N={placement.num_logical}, ranks={placement.num_ranks}, "
                f"P={placement.num_slots}), state has (N={self.num_logical}, "
                f"ranks={self.num_ranks}, P={self.num_slots})"
            )
        if placement.num_layers != self.num_layers:
            raise PlacementError(
                f"placement has {placement.num_layers} layers, state has {self.num_layers}"
            )
        log2phy = placement.log2phy(self.max_replicas)
        dtype = self.log2phy.dtype
        self.log2phy.copy_(log2phy.to(dtype), non_blocking=True)
        self.replica_count.copy_(placement.replica_count().to(dtype), non_blocking=True)
        self.phy2log.copy_(placement.phy2log.to(dtype), non_blocking=True)
        self._committed.copy_(placement.phy2log)
        self._committed_changed()
