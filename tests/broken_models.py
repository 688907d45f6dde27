"""Deliberately broken routed MoE samples: each commits one graph-capture sin the audit must flag.

Every sample is the project's :class:`~eplb_graph.models.TinyMoE` with exactly one defect, exposed
as a ``module:callable`` audit target returning ``(fn, example_args, eplb_state)``:

- :func:`host_sync_target`: routing reads the valid-token count back to the host (``.item()``);
- :func:`python_int_valid_count_target`: the valid-token count lives in a Python int attribute;
- :func:`rebinding_commit_target`: the commit replaces the lookup tensor instead of ``copy_``;
- :func:`dict_lookup_target`: the routing table is a Python dict read on the hot path;
- :func:`cloned_lookup_target`: routing reads private clones of the lookup, made at build time;
- :func:`constant_lookup_target`: the lookup is copied to Python lists at build time and rebuilt
  as a tensor (a constant of the graph) on every call;
- :func:`per_step_copy_target`: the state refreshes a private copy of the lookup every step;
- :func:`stale_view_target`: the model keeps views of the lookup made at build time, and the
  state's commit replaces the tensor they view.

The last four compile once, never sync and never recompile: their routing simply never sees a
commit, because they read a copy of the EPLB tables instead of the live ones.

They are written the way a real runner gets them wrong, so keep each defect on its own line: the
audit goldens in ``tests/test_audit.py`` pin the reported source lines.
"""

from __future__ import annotations

import torch

import eplb_graph
from eplb_graph.models import TinyMoE, TinyMoEConfig
from eplb_graph.ops import map_and_record, map_to_physical, record_load
from eplb_graph.placement import Placement

CONFIG = TinyMoEConfig(num_layers=2, hidden=16, intermediate=24, num_experts=8, top_k=2)
NUM_REDUNDANT, NUM_RANKS, TOKENS = 8, 4, 12


def _placement() -> Placement:
    return Placement.default(CONFIG.num_layers, CONFIG.num_experts, NUM_REDUNDANT, NUM_RANKS)


def _hidden() -> torch.Tensor:
    return torch.randn(TOKENS, CONFIG.hidden, generator=torch.Generator().manual_seed(0))


class _RoutingOverride(TinyMoE):
    """TinyMoE whose per-layer routing step is a method, so each sample overrides only that."""

    def route(self, layer: int, logical_ids: torch.Tensor) -> torch.Tensor:
        state = self.state
        return map_and_record(
            logical_ids,
            state.log2phy[layer],
            state.replica_count[layer],
            state.offset,
            state.load[layer],
            state.num_valid_tokens,
            state.record_enabled,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        top_k = self.config.top_k
        for layer in range(self.config.num_layers):
            logits = hidden @ self.router[layer]
            weights, logical_ids = torch.topk(torch.softmax(logits, dim=-1), top_k)
            flat = self.route(layer, logical_ids).reshape(-1).clamp_min(0)
            up = self.slot_up[layer].index_select(0, flat)
            down = self.slot_down[layer].index_select(0, flat)
            tokens = hidden.repeat_interleave(top_k, dim=0).unsqueeze(1)
            expert_out = torch.bmm(torch.relu(torch.bmm(tokens, up)), down).squeeze(1)
            combined = expert_out.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)
            hidden = hidden + combined.sum(dim=1)
        return hidden


# -- 1. host sync in routing ----------------------------------------------------------------------
class HostSyncMoE(_RoutingOverride):
    """Copies the valid-token count to the host to build the op's count argument."""

    def route(self, layer: int, logical_ids: torch.Tensor) -> torch.Tensor:
        state = self.state
        num_valid = state.num_valid_tokens.item()  # BROKEN: device -> host read every layer
        count = torch.full((), num_valid, dtype=torch.int64)
        return map_and_record(
            logical_ids,
            state.log2phy[layer],
            state.replica_count[layer],
            state.offset,
            state.load[layer],
            count,
            state.record_enabled,
        )


def host_sync_target():
    state = eplb_graph.EplbState(_placement())
    return HostSyncMoE(CONFIG, state), (_hidden(),), state


# -- 2. valid-token count as a Python int ---------------------------------------------------------
class PythonCountState(eplb_graph.EplbState):
    """Keeps a host copy of the valid-token count, which the model then reads."""

    def set_step_inputs_(self, num_valid_tokens: int, record: bool) -> None:
        super().set_step_inputs_(num_valid_tokens, record)
        self.num_valid_host = int(num_valid_tokens)


class PythonCountMoE(_RoutingOverride):
    def route(self, layer: int, logical_ids: torch.Tensor) -> torch.Tensor:
        state = self.state
        count = torch.full((), state.num_valid_host, dtype=torch.int64)  # BROKEN: Python int
        return map_and_record(
            logical_ids,
            state.log2phy[layer],
            state.replica_count[layer],
            state.offset,
            state.load[layer],
            count,
            state.record_enabled,
        )


def python_int_valid_count_target():
    state = PythonCountState(_placement())
    state.set_step_inputs_(TOKENS, True)
    return PythonCountMoE(CONFIG, state), (_hidden(),), state


# -- 3. a commit that rebinds the lookup table ----------------------------------------------------
class RebindingState(eplb_graph.EplbState):
    """Commits by building fresh tables and assigning them: graphs keep reading the old ones."""

    def commit_(self, placement: Placement) -> None:
        super().commit_(placement)
        fresh = placement.log2phy(self.max_replicas).to(self.log2phy.dtype)
        self.log2phy = fresh.to(self.device)  # BROKEN: a new tensor, not log2phy.copy_(fresh)


def rebinding_commit_target():
    state = RebindingState(_placement())
    return TinyMoE(CONFIG, state), (_hidden(),), state


# -- 4. a Python dict on the hot path -------------------------------------------------------------
class DictTableState(eplb_graph.EplbState):
    """Mirrors each expert's first replica into a Python dict, refreshed on every commit."""

    def __init__(self, placement: Placement, **kwargs) -> None:
        super().__init__(placement, **kwargs)
        self.first_slot: dict[tuple[int, int], int] = {}
        self._refresh_table()

    def _refresh_table(self) -> None:
        first = self.log2phy[..., 0]
        for layer in range(self.num_layers):
            for expert in range(self.num_logical):
                self.first_slot[layer, expert] = int(first[layer, expert])

    def commit_(self, placement: Placement) -> None:
        super().commit_(placement)
        self._refresh_table()


class DictLookupMoE(_RoutingOverride):
    def route(self, layer: int, logical_ids: torch.Tensor) -> torch.Tensor:
        state = self.state
        slots = [state.first_slot[layer, e] for e in range(state.num_logical)]  # BROKEN: dict
        table = torch.tensor(slots, dtype=torch.int64).unsqueeze(1)
        ones = torch.ones(state.num_logical, dtype=torch.int64)
        physical = map_to_physical(logical_ids, table, ones, state.offset)
        record_load(state.load[layer], physical, state.num_valid_tokens, state.record_enabled)
        return physical


def dict_lookup_target():
    state = DictTableState(_placement())
    return DictLookupMoE(CONFIG, state), (_hidden(),), state


# -- 5. private clones of the lookup, made at build time ------------------------------------------
class ClonedLookupMoE(_RoutingOverride):
    """Keeps its own copy of each layer's lookup as a buffer (it "belongs to the module")."""

    def __init__(self, config: TinyMoEConfig, state: eplb_graph.EplbState) -> None:
        super().__init__(config, state)
        for layer in range(config.num_layers):
            self.register_buffer(f"log2phy_{layer}", state.log2phy[layer].clone())  # BROKEN: copy

    def route(self, layer: int, logical_ids: torch.Tensor) -> torch.Tensor:
        state = self.state
        lookup = getattr(self, f"log2phy_{layer}")
        return map_and_record(
            logical_ids,
            lookup,
            state.replica_count[layer],
            state.offset,
            state.load[layer],
            state.num_valid_tokens,
            state.record_enabled,
        )


def cloned_lookup_target():
    state = eplb_graph.EplbState(_placement())
    return ClonedLookupMoE(CONFIG, state), (_hidden(),), state


# -- 6. the lookup as a constant: Python lists made at build time ---------------------------------
class ConstantLookupMoE(_RoutingOverride):
    """Copies the lookup to Python lists once and builds the op's table from them per call."""

    def __init__(self, config: TinyMoEConfig, state: eplb_graph.EplbState) -> None:
        super().__init__(config, state)
        self.lookup_rows = state.log2phy.tolist()  # BROKEN: a host copy, frozen into the graph

    def route(self, layer: int, logical_ids: torch.Tensor) -> torch.Tensor:
        state = self.state
        lookup = torch.tensor(self.lookup_rows[layer], dtype=state.log2phy.dtype)
        return map_and_record(
            logical_ids,
            lookup,
            state.replica_count[layer],
            state.offset,
            state.load[layer],
            state.num_valid_tokens,
            state.record_enabled,
        )


def constant_lookup_target():
    state = eplb_graph.EplbState(_placement())
    return ConstantLookupMoE(CONFIG, state), (_hidden(),), state


# -- 7. a private copy of the lookup, refreshed every step ----------------------------------------
class PerStepCopyState(eplb_graph.EplbState):
    """Hands the model a fresh copy of the lookup at every step instead of the live tensor."""

    def set_step_inputs_(self, num_valid_tokens: int, record: bool) -> None:
        super().set_step_inputs_(num_valid_tokens, record)
        self.routing_copy = self.log2phy.clone()  # BROKEN: a copy; captured graphs keep the old


class PerStepCopyMoE(_RoutingOverride):
    def route(self, layer: int, logical_ids: torch.Tensor) -> torch.Tensor:
        state = self.state
        lookup = state.routing_copy[layer]
        return map_and_record(
            logical_ids,
            lookup,
            state.replica_count[layer],
            state.offset,
            state.load[layer],
            state.num_valid_tokens,
            state.record_enabled,
        )


def per_step_copy_target():
    state = PerStepCopyState(_placement())
    state.set_step_inputs_(TOKENS, True)
    return PerStepCopyMoE(CONFIG, state), (_hidden(),), state


# -- 8. views of a lookup tensor the commit replaces ----------------------------------------------
class CachedViewsMoE(_RoutingOverride):
    """Takes each layer's lookup view once, at build time."""

    def __init__(self, config: TinyMoEConfig, state: eplb_graph.EplbState) -> None:
        super().__init__(config, state)
        self.lookup_views = [state.log2phy[layer] for layer in range(config.num_layers)]

    def route(self, layer: int, logical_ids: torch.Tensor) -> torch.Tensor:
        state = self.state
        lookup = self.lookup_views[layer]  # BROKEN: a view of the tensor the state had at build
        return map_and_record(
            logical_ids,
            lookup,
            state.replica_count[layer],
            state.offset,
            state.load[layer],
            state.num_valid_tokens,
            state.record_enabled,
        )


def stale_view_target():
    state = RebindingState(_placement())
    return CachedViewsMoE(CONFIG, state), (_hidden(),), state


TARGETS = {
    "host_sync": "tests.broken_models:host_sync_target",
    "python_int_valid_count": "tests.broken_models:python_int_valid_count_target",
    "rebinding_commit": "tests.broken_models:rebinding_commit_target",
    "dict_lookup": "tests.broken_models:dict_lookup_target",
    "cloned_lookup": "tests.broken_models:cloned_lookup_target",
    "constant_lookup": "tests.broken_models:constant_lookup_target",
    "per_step_copy": "tests.broken_models:per_step_copy_target",
    "stale_view": "tests.broken_models:stale_view_target",
}
