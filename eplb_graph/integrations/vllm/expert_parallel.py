"""Expert parallelism on vLLM's CPU fused-MoE kernel: physical slots to local expert rows.

vLLM's CPU EP is "replicated tokens, partial sums, all-reduce": every EP rank routes every token
and runs only the experts it holds, and the combine all-reduces the partial outputs. The
unquantized CPU kernel wrapper receives the rank's ``expert_map`` (physical slot -> local row, -1
when the slot lives elsewhere) but hands the kernel global slot ids, which index past the local
weights. This wrapper translates slots to local rows first and excludes non-local choices by
giving them weight 0 (on local row 0), so each rank adds exactly its own slots' contributions
and the combine is unchanged. It is pure tensor code: it traces into the compiled graph.
"""

from __future__ import annotations

import functools

import torch


def to_local(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_ids [T, K]`` physical slots -> local rows; non-local choices get weight 0."""
    local = expert_map.index_select(0, topk_ids.reshape(-1).long()).view(topk_ids.shape)
    here = local >= 0
    ids = torch.where(here, local, torch.zeros_like(local)).to(topk_ids.dtype)
    weights = torch.where(here, topk_weights, torch.zeros_like(topk_weights))
    return ids, weights


def install() -> None:
    from eplb_graph.integrations.vllm.compat import CPU_EXPERTS_APPLY

    owner, name, apply = CPU_EXPERTS_APPLY.owner_and_value()
    if getattr(apply, "__wrapped__", None) is not None:
        return

    @functools.wraps(apply)
    def apply_on_local_rows(
        self,
        output,
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation,
        global_num_experts,
        expert_map,
        a1q_scale,
        a2_scale,
        workspace13,
        workspace2,
        expert_tokens_meta,
        apply_router_weight_on_input,
    ):
        if expert_map is not None:
            topk_ids, topk_weights = to_local(topk_ids, topk_weights, expert_map)
        return apply(
            self,
            output,
            hidden_states,
            w1,
            w2,
            topk_weights,
            topk_ids,
            activation,
            global_num_experts,
            expert_map,
            a1q_scale,
            a2_scale,
            workspace13,
            workspace2,
            expert_tokens_meta,
            apply_router_weight_on_input,
        )

    setattr(owner, name, apply_on_local_rows)
