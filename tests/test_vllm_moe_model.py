"""Models without vLLM's ``MixtureOfExperts`` interface (GPT-OSS), without an engine.

The engine tests are in ``test_vllm_families.py``; these check the pieces they rely on: the
checkpoint stream expanded to physical slots, the partial signature check of the factory
patch, and the refusals of the supplied MoE interface, each naming its reason.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("vllm", reason="the vllm extra is not installed: pip install -e '.[vllm]'")

from eplb_graph.errors import EplbError
from eplb_graph.integrations.vllm.compat import GPT_OSS_FACTORY, PatchTarget
from eplb_graph.integrations.vllm.gpt_oss import GptOssRedundantSlotsError, _expanded
from eplb_graph.integrations.vllm.moe_model import UnsupportedVllmModel, moe_model


def test_fused_expert_tensors_expand_to_the_default_physical_layout():
    n, redundant = 4, 2
    w13 = torch.arange(n * 3.0).view(n, 3)
    bias = torch.arange(n * 2.0).view(n, 2)
    other = torch.ones(n, 5)  # not an expert tensor: unchanged, even with N rows
    stream = [
        ("layers.0.mlp.experts.w13_weight", w13),
        ("layers.0.mlp.experts.w2_bias", bias),
        ("layers.0.attn.qkv_proj.weight", other),
    ]
    out = dict(_expanded(iter(stream), n, redundant))
    slots = torch.arange(n + redundant) % n
    assert torch.equal(out["layers.0.mlp.experts.w13_weight"], w13[slots])
    assert torch.equal(out["layers.0.mlp.experts.w2_bias"], bias[slots])
    assert out["layers.0.attn.qkv_proj.weight"] is other


def test_per_expert_checkpoint_tensors_are_refused_with_redundant_slots():
    stream = [("layers.0.mlp.experts.3.w13_weight", torch.zeros(2, 2))]
    with pytest.raises(GptOssRedundantSlotsError, match="holds one expert"):
        list(_expanded(iter(stream), 4, 2))


def test_the_factory_target_checks_the_parameters_the_patch_passes():
    assert GPT_OSS_FACTORY.problem() is None
    missing = PatchTarget(GPT_OSS_FACTORY.module, GPT_OSS_FACTORY.attribute, ("no_such",), True)
    assert "expected ['no_such']" in missing.problem()


def test_a_model_without_moe_layers_is_refused_by_name():
    with pytest.raises(UnsupportedVllmModel, match="Linear has no MoE layer") as info:
        moe_model(nn.Linear(2, 2), 2)
    assert isinstance(info.value, EplbError)
