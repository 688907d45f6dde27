"""What EPLB needs of a served MoE model, supplied when vLLM's model class does not implement it.

vLLM's EPLB reads a model through its ``MixtureOfExperts`` interface (MoE layers, expert counts,
``set_eplb_state``). Some models vLLM serves with expert parallelism lack it (GPT-OSS in vLLM
0.32), although their MoE layers are vLLM's ordinary ``MoERunner`` objects. For those the
plugin builds the same facts from the layers themselves. It refuses, naming the layer and the
reason, when the layers could not be balanced: built without EPLB (the router would never map
logical experts to physical slots), or without the configured redundant slots, or with
differing expert counts.
"""

from __future__ import annotations

from typing import Any

from eplb_graph.errors import EplbError


class UnsupportedVllmModel(EplbError, RuntimeError):
    """The loaded model or its expert kernel cannot be balanced by eplb-graph under vLLM."""


class SuppliedMixtureOfExperts:
    """The ``MixtureOfExperts`` facts of a model that does not state them, read from its layers."""

    num_shared_experts = 0
    num_expert_groups = 1

    def __init__(self, model: Any, layers: list[Any]) -> None:
        self.model = model
        self.moe_layers = layers
        self.num_moe_layers = len(layers)
        config = layers[0].routed_experts.moe_config
        self.num_logical_experts = int(config.num_logical_experts)
        self.num_physical_experts = int(config.num_experts)
        self.num_local_physical_experts = int(config.num_local_experts)
        self.num_routed_experts = self.num_logical_experts
        self.num_redundant_experts = self.num_physical_experts - self.num_logical_experts
        self.expert_weights: list[list[Any]] = []

    def set_eplb_state(self, expert_load_view, logical_to_physical_map, logical_replica_count):
        """As vLLM's ``MixtureOfExperts.set_eplb_state``: every layer reads rows of one state."""
        self.expert_weights = []
        for index, layer in enumerate(self.moe_layers):
            self.expert_weights.append(list(layer.get_expert_weights()))
            layer.set_eplb_state(
                moe_layer_idx=index,
                expert_load_view=expert_load_view,
                logical_to_physical_map=logical_to_physical_map,
                logical_replica_count=logical_replica_count,
            )


def moe_model(model: Any, num_redundant_experts: int):
    """vLLM's ``MixtureOfExperts`` view of ``model``, or one supplied from its MoE layers."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    from vllm.model_executor.models.interfaces import get_mixture_of_experts_model

    found = get_mixture_of_experts_model(model)
    if found is not None:
        return found
    name = type(model).__name__
    layers = [module for module in model.modules() if isinstance(module, MoERunner)]
    if not layers:
        raise UnsupportedVllmModel(
            f"enable_eplb is set but {name} has no MoE layer vLLM can rebalance (neither vLLM's "
            "MixtureOfExperts interface nor any MoERunner layer)"
        )
    supplied = SuppliedMixtureOfExperts(model, layers)
    for index, layer in enumerate(layers):
        config = layer.routed_experts.moe_config
        counts = (int(config.num_logical_experts), int(config.num_experts))
        if layer.eplb_state is None:
            raise UnsupportedVllmModel(
                f"{name} lacks vLLM's MixtureOfExperts interface and its MoE layer {index} was "
                "built without EPLB (vLLM's model code passes no enable_eplb), so its router "
                "never maps experts to slots; eplb-graph supplies that for GptOssForCausalLM only"
            )
        if counts != (supplied.num_logical_experts, supplied.num_physical_experts):
            raise UnsupportedVllmModel(
                f"{name}: MoE layer {index} has {counts[0]} experts in {counts[1]} slots, layer "
                f"0 has {supplied.num_logical_experts} in {supplied.num_physical_experts}; "
                "eplb-graph balances layers of one shape"
            )
    if supplied.num_redundant_experts != num_redundant_experts:
        raise UnsupportedVllmModel(
            f"{name} was built with {supplied.num_redundant_experts} redundant slots per MoE "
            f"layer, the engine asks for num_redundant_experts={num_redundant_experts} (vLLM's "
            "model code does not pass them to its MoE layers)"
        )
    return supplied
