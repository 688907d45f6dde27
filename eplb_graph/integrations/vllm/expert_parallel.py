"""Expert parallelism on vLLM's CPU fused-MoE kernel: physical slots to local expert rows.

vLLM's CPU EP is "replicated tokens, partial sums, all-reduce": every EP rank routes every token
and runs only the experts it holds, and the combine all-reduces the partial outputs. The
unquantized CPU kernel wrapper receives the rank's ``expert_map`` (physical slot -> local row, -1
when the slot lives elsewhere) but hands the kernel global slot ids, which index past the local
weights. This wrapper instead calls ``torch.ops.eplb_graph.vllm_local_experts``
(:mod:`local_rows`): vLLM's same kernel on only the rank's own (token, k) rows, so each rank adds
exactly its own slots' contributions, does work proportional to them, and the combine is
unchanged. The op has a fixed output shape and a fake kernel: it traces into the compiled graph.
The experts object's ``eplb_stats`` (set by the runner glue to ``EplbState.expert_stats[layer]``)
receives the rows and nanoseconds; without EPLB a scratch row does.
"""

from __future__ import annotations

import functools

import torch

from eplb_graph.integrations.vllm.local_rows import vllm_local_experts

_SCRATCH_STATS = torch.zeros(2, dtype=torch.int64)
"""Stats row of experts objects no EplbState owns (expert parallelism without EPLB)."""


def to_local(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, expert_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_ids [T, K]`` physical slots -> local rows; non-local choices get weight 0.

    The former path (every rank computes all ``T x K`` rows); kept for vLLM's zentorch kernel,
    which the compacted-rows op does not call, and as the baseline the tests compare against.
    """
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
        if expert_map is not None and not getattr(self, "_use_zentorch", False):
            stats = getattr(self, "eplb_stats", None)
            output.copy_(
                vllm_local_experts(
                    hidden_states,
                    topk_ids,
                    topk_weights,
                    expert_map,
                    [w1, w2, self.w1_bias, self.w2_bias],
                    _SCRATCH_STATS if stats is None else stats,
                    "cpu_fused_moe",
                    activation.value,
                    self.isa,
                    apply_router_weight_on_input,
                )
            )
            return None
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
