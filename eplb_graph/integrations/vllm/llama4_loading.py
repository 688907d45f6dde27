"""Llama 4 loads with redundant slots: its fused expert weights expanded to physical slots.

vLLM 0.32's ``Llama4Model.load_moe_expert_weights`` reads a fused checkpoint tensor
``[N experts, ...]`` and, under expert parallelism, indexes it with the rank's *physical* slot ids
(``expert_map != -1``). With redundant slots those ids run past ``N`` (``IndexError: index 8 is
out of bounds for dimension 0 with size 8``). At load time vLLM's layout is the default one
(slot ``p`` holds expert ``p mod N``), so the wrapper hands vLLM the checkpoint tensor expanded to
physical slots, ``weight[arange(N + R) % N]``: vLLM's own indexing then picks, for every local
slot, the expert that slot holds. Nothing else in vLLM's loader changes.
"""

from __future__ import annotations

import functools

import torch


def physical_rows(loaded_weight: torch.Tensor, num_redundant: int) -> torch.Tensor:
    """``[N, ...]`` per-expert rows -> ``[N + R, ...]``: row ``p`` is expert ``p mod N``."""
    num_logical = loaded_weight.shape[0]
    index = torch.arange(num_logical + num_redundant, device=loaded_weight.device) % num_logical
    return loaded_weight.index_select(0, index)


def install() -> None:
    from eplb_graph.integrations.vllm.compat import LLAMA4_LOAD_EXPERTS

    owner, name, load = LLAMA4_LOAD_EXPERTS.owner_and_value()
    if getattr(load, "__wrapped__", None) is not None:
        return

    @functools.wraps(load)
    def load_into_physical_slots(
        self, name, loaded_weight, params_dict, loaded_params, expert_params_mapping, fused=True
    ):
        redundant = int(getattr(self, "n_redundant_experts", 0) or 0)
        if fused and redundant > 0 and loaded_weight.ndim == 3 and "experts." in name:
            loaded_weight = physical_rows(loaded_weight, redundant)
        return load(
            self, name, loaded_weight, params_dict, loaded_params, expert_params_mapping, fused
        )

    setattr(owner, name, load_into_physical_slots)
