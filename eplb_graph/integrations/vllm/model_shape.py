"""How many MoE layers a model will have, read from its configuration before any worker starts.

The engine's configuration is built in the front-end process, long before a worker loads the
model (80 s on a small CPU engine). A setting that must fit the model's shape (an expert map's
layer count, ``layers_per_step``) is checked there when the family's layer rule is known here;
the workers check again against the loaded model, which is the last word.

The rules mirror the families' vLLM model code (which decoder layers get a sparse MoE block).
An unknown family gives ``None`` and only the upper bound ``num_hidden_layers`` applies.
"""

from __future__ import annotations

from typing import Any


def moe_layer_count(model_config: Any) -> int | None:
    """MoE layers of the model ``model_config`` describes, or ``None`` for an unknown family."""
    config = getattr(model_config, "hf_text_config", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 0:
        return None
    kind = getattr(config, "model_type", "")
    if kind in ("qwen2_moe", "qwen3_moe"):
        only = set(getattr(config, "mlp_only_layers", None) or ())
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        if not getattr(config, "num_experts", 0):
            return 0
        return sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
    if kind in ("llama4", "llama4_text"):
        step = int(getattr(config, "interleave_moe_layer_step", 1) or 0)
        return sum(1 for i in range(layers) if step > 0 and (i + 1) % step == 0)
    if kind in ("deepseek_v2", "deepseek_v3"):
        if getattr(config, "n_routed_experts", None) is None:
            return 0
        first = int(getattr(config, "first_k_dense_replace", 0) or 0)
        frequency = int(getattr(config, "moe_layer_freq", 1) or 1)
        return sum(1 for i in range(layers) if i >= first and i % frequency == 0)
    if kind in ("mixtral", "gpt_oss"):
        return layers
    return None


def hidden_layer_count(model_config: Any) -> int | None:
    """The model's decoder layers: an upper bound of its MoE layers for any family."""
    layers = getattr(getattr(model_config, "hf_text_config", None), "num_hidden_layers", None)
    return layers if isinstance(layers, int) and not isinstance(layers, bool) else None
