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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from eplb_graph.integrations.vllm.local_rows import vllm_local_experts

if TYPE_CHECKING:
    from eplb_graph.integrations.vllm.compat import PatchTarget

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

    wrap_apply(CPU_EXPERTS_APPLY, _unquantized_local_rows)


def _unquantized_local_rows(call: dict[str, Any]) -> bool:
    """vLLM's unquantized CPU kernel on this rank's rows (zentorch: the former local ids)."""
    experts, expert_map = call["self"], call["expert_map"]
    if expert_map is None:
        return False
    if getattr(experts, "_use_zentorch", False):
        call["topk_ids"], call["topk_weights"] = to_local(
            call["topk_ids"], call["topk_weights"], expert_map
        )
        return False
    stats = getattr(experts, "eplb_stats", None)
    call["output"].copy_(
        vllm_local_experts(
            call["hidden_states"],
            call["topk_ids"],
            call["topk_weights"],
            expert_map,
            [call["w1"], call["w2"], experts.w1_bias, experts.w2_bias],
            _SCRATCH_STATS if stats is None else stats,
            "cpu_fused_moe",
            call["activation"].value,
            experts.isa,
            call["apply_router_weight_on_input"],
        )
    )
    return True


def wrap_apply(target: PatchTarget, on_local_rows: Callable[[dict[str, Any]], bool]) -> None:
    """Wrap an experts class's ``apply`` (``target``) so ``on_local_rows`` sees each call first.

    ``on_local_rows(call)`` gets the call's arguments by name (the names ``target.parameters``
    spells once, checked against vLLM by ``compat``) and returns True when it wrote ``output``
    itself, or False to let vLLM's ``apply`` run on the arguments, which it may have edited.
    Installing twice wraps once.
    """
    owner, name, apply = target.owner_and_value()
    if getattr(apply, "__wrapped__", None) is not None:
        return
    parameters, expected = target.parameters, frozenset(target.parameters)

    @functools.wraps(apply)
    def apply_on_local_rows(*args: Any, **kwargs: Any) -> Any:
        call = dict(zip(parameters, args, strict=False))
        call.update(kwargs)
        if len(args) + len(kwargs) != len(call) or call.keys() != expected:
            raise TypeError(
                f"{target.name} takes {list(parameters)}, got {len(args)} positional and "
                f"{sorted(kwargs)} keyword arguments"
            )
        if on_local_rows(call):
            return None
        return apply(**call)

    setattr(owner, name, apply_on_local_rows)
