"""GPT-OSS under EPLB: redundant slots built and loaded where vLLM 0.32's model code does not.

vLLM's ``GptOssForCausalLM`` does not implement ``MixtureOfExperts`` and its ``MLPBlock`` builds
its experts with neither ``enable_eplb`` nor ``num_redundant_experts``, so with
``num_redundant_experts = R`` vLLM would serve ``N`` slots while eplb-graph plans ``N + R``. Two
patches, both inside vLLM's ``gpt_oss`` module only, close that gap:

- the module's ``FusedMoEFactory`` name is wrapped to pass ``enable_eplb`` and
  ``num_redundant_experts`` from the engine's parallel config (what Mixtral and Qwen3-MoE pass
  themselves), so every MoE layer has ``N + R`` physical slots, ``(N + R) / EP`` per rank;
- its unquantized loader (``GptOssModel._load_weights_other``) slices a fused checkpoint tensor
  ``[N, ...]`` with *logical* bounds ``ep_rank * N / EP``. It is handed the tensor expanded to
  vLLM's load-time layout instead (slot ``p`` holds expert ``p mod N``, as
  :func:`llama4_loading.physical_rows`) and the rank's *physical* bounds, so each local slot
  receives the expert it holds, biases included.

The MoE interface itself (layers, counts, ``set_eplb_state``) comes from :mod:`moe_model`. The
mxfp4 and quark loaders are not changed: with redundant slots they are refused by name.
"""

from __future__ import annotations

import functools
import re

from eplb_graph.errors import EplbError
from eplb_graph.integrations.vllm.llama4_loading import physical_rows

EXPERT_TENSORS = (".w13_weight", ".w2_weight", ".w13_bias", ".w2_bias")
"""vLLM's names (after its checkpoint mapper) of GPT-OSS's fused per-expert tensors."""
_PER_EXPERT = re.compile(r"\.mlp\.experts\.\d+\.")


class GptOssRedundantSlotsError(EplbError, RuntimeError):
    """GPT-OSS weights in a format whose loader eplb-graph does not expand to physical slots."""


def _eplb_settings() -> tuple[bool, int]:
    from vllm.config import get_current_vllm_config

    parallel = get_current_vllm_config().parallel_config
    if not parallel.enable_eplb:
        return False, 0
    return True, int(parallel.eplb_config.num_redundant_experts or 0)


def install() -> None:
    from eplb_graph.integrations.vllm.compat import (
        GPT_OSS_FACTORY,
        GPT_OSS_LOAD,
        GPT_OSS_LOAD_OTHER,
    )

    owner, name, factory = GPT_OSS_FACTORY.owner_and_value()
    if getattr(factory, "__wrapped__", None) is None:

        @functools.wraps(factory)
        def factory_with_eplb(*args, **kwargs):
            enabled, redundant = _eplb_settings()
            if enabled and not kwargs.get("enable_eplb"):
                kwargs.update(enable_eplb=True, num_redundant_experts=redundant)
            return factory(*args, **kwargs)

        setattr(owner, name, factory_with_eplb)

    owner, name, load_other = GPT_OSS_LOAD_OTHER.owner_and_value()
    if getattr(load_other, "__wrapped__", None) is None:

        @functools.wraps(load_other)
        def load_into_physical_slots(
            self, ep_rank_end, ep_rank_start, heads_per_rank, head_start, weights, stacked
        ):
            enabled, redundant = _eplb_settings()
            if enabled and redundant > 0 and self.parallel_config.enable_expert_parallel:
                from vllm.distributed.parallel_state import get_ep_group

                group = get_ep_group()
                num_logical = self.config.num_local_experts
                per_rank = (num_logical + redundant) // group.world_size
                ep_rank_start = group.rank_in_group * per_rank
                ep_rank_end = ep_rank_start + per_rank
                weights = _expanded(weights, num_logical, redundant)
            return load_other(
                self, ep_rank_end, ep_rank_start, heads_per_rank, head_start, weights, stacked
            )

        setattr(owner, name, load_into_physical_slots)

    owner, name, load = GPT_OSS_LOAD.owner_and_value()
    if getattr(load, "__wrapped__", None) is None:

        @functools.wraps(load)
        def load_checked(self, weights):
            enabled, redundant = _eplb_settings()
            quantization = getattr(self.config, "quantization_config", None)
            method = quantization.get("quant_method") if isinstance(quantization, dict) else None
            if enabled and redundant > 0 and method is not None:
                raise GptOssRedundantSlotsError(
                    f"GPT-OSS with {method} experts and num_redundant_experts={redundant}: "
                    "eplb-graph expands only unquantized GPT-OSS checkpoints to redundant slots "
                    "(vLLM's GPT-OSS model builds none); serve it with num_redundant_experts=0 "
                    "or an unquantized checkpoint"
                )
            return load(self, weights)

        setattr(owner, name, load_checked)


def _expanded(weights, num_logical: int, redundant: int):
    """The checkpoint stream with every fused expert tensor ``[N, ...]`` -> ``[N + R, ...]``.

    Per-expert tensors (``...mlp.experts.<id>.<name>``, vLLM's "streamed" GPT-OSS format) would
    load each expert into its own slot only and leave the redundant slots empty: refused.
    """
    for name, weight in weights:
        if _PER_EXPERT.search(name):
            raise GptOssRedundantSlotsError(
                f"GPT-OSS checkpoint tensor {name!r} holds one expert: eplb-graph expands only "
                "fused expert tensors [experts, ...] to redundant slots; serve this checkpoint "
                "with num_redundant_experts=0"
            )
        if name.endswith(EXPERT_TENSORS) and weight.ndim >= 2 and weight.shape[0] == num_logical:
            weight = physical_rows(weight, redundant)
        yield name, weight
