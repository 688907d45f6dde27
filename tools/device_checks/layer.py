"""One MoE layer as a captured graph sees it: router -> top-k -> ``map_and_record`` -> expert
compute on physical slots (``local_experts``), over an :class:`~eplb_graph.EplbState`.

Why its own layer rather than the tiny model: the checks need the physical ids as an output
(routing compared exactly, not only through the hidden states) and the expert op that the vLLM
plugin runs, with slot weights that a commit rewrites in place, the way the movement plane does.
If a slot held the wrong expert's weights after a commit, the output would differ from eager.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eplb_graph import EplbState, Placement
from eplb_graph.ops import local_experts, map_and_record


@dataclass(frozen=True)
class LayerShape:
    num_experts: int = 16
    num_redundant: int = 16
    num_ranks: int = 4
    hidden: int = 64
    intermediate: int = 128
    top_k: int = 4
    tokens: int = 64


@dataclass(frozen=True)
class StepKnob:
    """Per-step host inputs (written in place between replays)."""

    valid_tokens: int
    record: bool
    offset_advance: int


def step_knobs(shape: LayerShape) -> list[StepKnob]:
    """A full step, a padded step (the last quarter of the rows padding) and a step that does
    not record: what a serving loop changes between replays without re-capturing."""
    return [
        StepKnob(shape.tokens, True, 1),
        StepKnob(shape.tokens * 3 // 4, True, 3),
        StepKnob(shape.tokens, False, 1),
    ]


class RoutedMoELayer(torch.nn.Module):
    """``hidden [T, H] -> (out [T, H], physical ids [T, K])`` reading ``state``'s live tables.

    Slot weights ``w13 [P, 2I, H]`` / ``w2 [P, H, I]`` hold, slot by slot, the weights of the
    expert the committed placement puts there; :meth:`install_weights_` rewrites them in place.
    Every slot is local (one device plays every rank), so ``slot_to_local`` is the identity.
    """

    def __init__(self, shape: LayerShape, state: EplbState, seed: int = 0) -> None:
        super().__init__()
        self.shape = shape
        self.state = state
        generator = torch.Generator().manual_seed(seed)
        n, h, i = shape.num_experts, shape.hidden, shape.intermediate
        device = state.device
        self.router = torch.randn(h, n, generator=generator).to(device)
        self.expert_w13 = (torch.randn(n, 2 * i, h, generator=generator) / h**0.5).to(device)
        self.expert_w2 = (torch.randn(n, h, i, generator=generator) / i**0.5).to(device)
        slots = state.num_slots
        self.slot_to_local = torch.arange(slots, dtype=torch.int64, device=device)
        self.w13 = torch.empty(slots, 2 * i, h, device=device)
        self.w2 = torch.empty(slots, h, i, device=device)
        self.stats = torch.zeros(3, dtype=torch.int64, device=device)
        self.install_weights_()
        for tensor in (self.router, self.slot_to_local, self.w13, self.w2, self.stats):
            torch._dynamo.mark_static_address(tensor, guard=False)

    def install_weights_(self) -> int:
        """Write every slot's weights from the committed placement, in place; returns how many
        slots changed expert since the last install (weights moved between slots)."""
        phy2log = self.state.phy2log[0].to(torch.int64)
        before = getattr(self, "_installed", None)
        self.w13.copy_(self.expert_w13.index_select(0, phy2log))
        self.w2.copy_(self.expert_w2.index_select(0, phy2log))
        self._installed = phy2log.clone()
        return 0 if before is None else int((before != phy2log).sum())

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.state
        logits = hidden @ self.router
        weights, logical = torch.topk(torch.softmax(logits, dim=-1), self.shape.top_k)
        physical = map_and_record(
            logical,
            state.log2phy[0],
            state.replica_count[0],
            state.offset,
            state.load[0],
            state.num_valid_tokens,
            state.record_enabled,
        )
        out = local_experts(
            hidden,
            physical,
            weights,
            self.slot_to_local,
            self.w13,
            self.w2,
            self.stats,
            state.num_valid_tokens,
        )
        return out, physical


def build_layer(shape: LayerShape, device: torch.device | str) -> RoutedMoELayer:
    placement = Placement.default(1, shape.num_experts, shape.num_redundant, shape.num_ranks)
    state = EplbState(placement, device=device, rank=1)
    state.set_step_inputs_(shape.tokens, True)
    return RoutedMoELayer(shape, state)


def example_hidden(shape: LayerShape, device: torch.device | str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randn(shape.tokens, shape.hidden, generator=generator).to(device)


def placements(shape: LayerShape, count: int, seed: int = 1) -> list[Placement]:
    """``count`` valid placements, each different from the one before it and from the default:
    every expert at least once, the redundant slots to random experts, slots shuffled, so most
    slots change expert (weights move) at every commit."""
    generator = torch.Generator().manual_seed(seed)
    n, extra = shape.num_experts, shape.num_redundant
    result: list[Placement] = []
    previous = Placement.default(1, n, extra, shape.num_ranks).phy2log[0]
    while len(result) < count:
        redundant = torch.randint(0, n, (extra,), generator=generator)
        row = torch.cat([torch.arange(n), redundant])
        row = row[torch.randperm(row.numel(), generator=generator)]
        if torch.equal(row, previous):
            continue
        result.append(Placement(row.unsqueeze(0), n, shape.num_ranks))
        previous = row
    return result
