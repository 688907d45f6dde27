"""A tiny MoE stack whose routing goes through ``map_and_record`` and the stable EPLB state.

Each layer: router logits -> top-k logical ids -> ``map_and_record`` (lookup gather, replica
choice, load record in one op) -> expert MLP on the *physical* slot's weights -> weighted combine.
Experts are selected once and compute consumes physical ids (invariant 2): if a slot held the
wrong expert's weights the output would change, which is what the equivalence tests rely on.

The EPLB tensors are read from the shared :class:`~eplb_graph.state.EplbState` objects, indexed
per layer *inside* the graph, so one graph input per tensor and no aliased inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from eplb_graph.ops import map_and_record
from eplb_graph.state import EplbState


@dataclass(frozen=True)
class TinyMoEConfig:
    num_layers: int = 2
    hidden: int = 16
    intermediate: int = 32
    num_experts: int = 8
    top_k: int = 2
    seed: int = 0


class TinyMoE(nn.Module):
    """Deterministic MoE stack over an :class:`EplbState` (slot weights ``[L, P, H, F]``).

    Slot weights are materialized from the placement: slot p of layer l holds expert
    ``phy2log[l, p]``'s weights. Moving weights (the movement plane) writes these tensors in place.
    """

    def __init__(self, config: TinyMoEConfig, state: EplbState) -> None:
        super().__init__()
        if state.num_logical != config.num_experts or state.num_layers != config.num_layers:
            raise ValueError(
                f"state has {state.num_layers} layers x {state.num_logical} experts, model "
                f"config has {config.num_layers} x {config.num_experts}"
            )
        self.config = config
        self.state = state
        generator = torch.Generator().manual_seed(config.seed)
        L, N, H, F = config.num_layers, config.num_experts, config.hidden, config.intermediate
        device = state.device
        router = torch.randn(L, H, N, generator=generator).to(device)  # same draws on any device
        self.router = nn.Parameter(router, requires_grad=False)
        # Logical expert weights (the "checkpoint", on the host); slots are filled from them by
        # placement.
        self.expert_up = torch.randn(L, N, H, F, generator=generator) / H**0.5
        self.expert_down = torch.randn(L, N, F, H, generator=generator) / F**0.5
        phy2log = state.placement.phy2log
        self.register_buffer("slot_up", self._slots(self.expert_up, phy2log).to(device))
        self.register_buffer("slot_down", self._slots(self.expert_down, phy2log).to(device))

    @staticmethod
    def _slots(expert_weights: torch.Tensor, phy2log: torch.Tensor) -> torch.Tensor:
        return torch.stack(
            [expert_weights[layer].index_select(0, phy2log[layer]) for layer in range(len(phy2log))]
        ).contiguous()

    def install_placement_weights_(self) -> None:
        """Overwrite slot weights in place from the committed placement (test helper)."""
        phy2log = self.state.placement.phy2log
        self.slot_up.copy_(self._slots(self.expert_up, phy2log))
        self.slot_down.copy_(self._slots(self.expert_down, phy2log))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H]`` -> ``[T, H]``; routes every layer through ``map_and_record``."""
        state = self.state
        num_tokens = hidden.shape[0]
        for layer in range(self.config.num_layers):
            logits = hidden @ self.router[layer]
            weights, logical_ids = torch.topk(torch.softmax(logits, dim=-1), self.config.top_k)
            physical_ids = map_and_record(
                logical_ids,
                state.log2phy[layer],
                state.replica_count[layer],
                state.offset,
                state.load[layer],
                state.num_valid_tokens,
                state.record_enabled,
            )
            flat = physical_ids.reshape(-1).clamp_min(0)
            up = self.slot_up[layer].index_select(0, flat)  # [T*K, H, F]
            down = self.slot_down[layer].index_select(0, flat)  # [T*K, F, H]
            tokens = hidden.repeat_interleave(self.config.top_k, dim=0).unsqueeze(1)
            expert_out = torch.bmm(torch.relu(torch.bmm(tokens, up)), down).squeeze(1)
            combined = expert_out.view(num_tokens, self.config.top_k, -1) * weights.unsqueeze(-1)
            hidden = hidden + combined.sum(dim=1)
        return hidden


def audit_target() -> tuple[TinyMoE, tuple[torch.Tensor], EplbState]:
    """The default ``eplb-graph audit`` target: a 2-layer TinyMoE over 16 slots on 4 ranks.

    Returns ``(model, (hidden,), state)`` with a decode-like step set (12 tokens, all valid,
    recording on), which is the shape of triple every audit target returns.
    """
    from eplb_graph.placement import Placement

    config = TinyMoEConfig(num_layers=2, hidden=16, intermediate=24, num_experts=8, top_k=2)
    placement = Placement.default(config.num_layers, config.num_experts, 8, 4)
    state = EplbState(placement, rank=1)
    state.set_step_inputs_(12, True)
    hidden = torch.randn(12, config.hidden, generator=torch.Generator().manual_seed(0))
    return TinyMoE(config, state), (hidden,), state
