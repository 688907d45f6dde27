"""W8A8 int8 experts under vLLM (0.32, CPU backend) with expert parallelism and EPLB.

Unit part (vLLM's int8 CPU kernel called directly, no engine): the local-rows op on the int8
kernel equals the kernel on every row, and the kernel equals a dequantized reference on this
CPU; the packing is per expert, so the ``cpu_int8_packed`` view moves an expert whole; the
weight-digest check passes when scales move with their weights and fails when they do not
(the planted mismatch).

Engine part: two families and vLLM's two W8A8 int8 MoE methods: a Qwen3-MoE compressed-tensors
checkpoint (written by ``eplb_graph.models.tiny_w8a8``) and a float Mixtral quantized online
(``quantization="experts_int8"``), served in bfloat16 with TP=2 + expert parallelism and 2
redundant slots. Per checkpoint: one engine in record mode (the same layout, EPLB off) and one
with EPLB on (synchronous, eager) and ``weight_digests``. Asserted: the tokens are identical,
at least 2 rearrangements commit on one placement on both ranks, and after every commit every
local slot's packed bytes, compensation and scales equal those of the expert the placement
names (``slot_digests.check_slot_digests``).
"""

from __future__ import annotations

import pytest
import torch
from quantized_moves import CHANGED_SLOTS, needs_kernels, problems_after_move

from eplb_graph.integrations.vllm.local_rows import vllm_local_experts
from eplb_graph.integrations.vllm.slot_digests import check_slot_digests
from eplb_graph.movement.views import CpuInt8PackedView, UnsupportedWeightFormat, make_expert_view

ops = pytest.importorskip("vllm._custom_ops", reason="the vllm extra is not installed")

pytestmark = pytest.mark.vllm
needs_kernel = needs_kernels("int8", ("fused_experts_cpu", "convert_weight_packed"))

E, H, INTER, K = 8, 128, 64, 2


def _int8_experts(seed: int = 0):
    """Random int8 experts, their scales, and vLLM's packing of them."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randint(-127, 128, (E, 2 * INTER, H), generator=gen, dtype=torch.int8)
    w2 = torch.randint(-127, 128, (E, H, INTER), generator=gen, dtype=torch.int8)
    s13 = torch.rand(E, 2 * INTER, 1, generator=gen) * 0.002 + 0.001
    s2 = torch.rand(E, H, 1, generator=gen) * 0.002 + 0.001
    pack = torch.ops._C.convert_weight_packed
    return w13, w2, s13, s2, pack(w13), pack(w2)


def _quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token symmetric int8, dequantized (what the kernel does to activations)."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 127
    return torch.round(x / scale).clamp(-127, 127) * scale


def _reference(hidden, ids, weights, w13, w2, s13, s2):
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(hidden.shape[0]):
        x = _quantize_rows(hidden[t].float())
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = ((w13[e].float() * s13[e]) @ x).chunk(2)
            h = _quantize_rows(torch.nn.functional.silu(gate) * up)
            out[t] += weights[t, k] * ((w2[e].float() * s2[e]) @ h)
    return out


@pytest.mark.parametrize("tokens", [1, 9, 40])
@needs_kernel
def test_int8_local_rows_of_two_ranks_sum_to_the_kernel_on_every_row(tokens):
    w13, w2, s13, s2, p13, p2 = _int8_experts(tokens)
    gen = torch.Generator().manual_seed(7 + tokens)
    hidden = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, E, (tokens, K), generator=gen, dtype=torch.int32)
    weights = torch.rand(tokens, K, generator=gen)
    whole = torch.empty_like(hidden)
    ops.fused_experts_cpu(
        whole, hidden, p13, p2, weights, ids, ops.CPUQuantMethod.INT8_W8A8, s13, s2,
        None, None, None, None, None, None, None, True,
    )  # fmt: skip
    total = torch.zeros(tokens, H)
    rows = 0
    for rank in range(2):
        local = slice(4 * rank, 4 * rank + 4)
        expert_map = torch.full((E,), -1, dtype=torch.int32)
        expert_map[local] = torch.arange(4, dtype=torch.int32)
        stats = torch.zeros(2, dtype=torch.int64)
        part = vllm_local_experts(
            hidden, ids, weights, expert_map,
            [p13[local], p2[local], s13[local], s2[local]], stats, "cpu_int8_w8a8",
        )  # fmt: skip
        rows += int(stats[0])
        total += part.float()
    assert rows == tokens * K
    reference = _reference(hidden, ids, weights, w13, w2, s13, s2)
    scale = reference.abs().max()
    # bf16 output rounding on both sides; the int8 arithmetic itself is exact
    assert (total - whole.float()).abs().max() <= 0.02 * scale
    assert (whole.float() - reference).abs().max() <= 0.03 * scale


@needs_kernel
def test_packing_is_per_expert_and_the_view_moves_weights_compensation_and_scales():
    w13, _, s13, s2, p13, p2 = _int8_experts(1)
    for e in range(E):
        assert torch.equal(torch.ops._C.convert_weight_packed(w13[e : e + 1])[0], p13[e])
    assert p13.shape == (E, 2 * INTER, H + 4) and p2.shape == (E, H, INTER + 4)
    view = make_expert_view(
        "cpu_int8_packed", {"w13": p13, "w2": p2, "w13_scale": s13, "w2_scale": s2}
    )
    assert isinstance(view, CpuInt8PackedView)
    assert view.slot_nbytes >= p13[0].numel() + p2[0].numel() + 4 * (s13[0].numel() + s2[0].numel())
    payload = torch.empty(view.slot_nbytes, dtype=torch.uint8)
    view.pack_slot(5, payload)
    view.unpack_slot_(0, payload)
    for tensor in (p13, p2, s13, s2):
        assert torch.equal(tensor[0], tensor[5])


@needs_kernel
def test_the_view_refuses_unpacked_weights_and_scales_of_another_shape():
    w13, w2, s13, s2, p13, p2 = _int8_experts(2)
    with pytest.raises(UnsupportedWeightFormat, match="compensation"):
        CpuInt8PackedView(w13, w2, s13, s2)
    with pytest.raises(UnsupportedWeightFormat, match="output channels"):
        CpuInt8PackedView(p13, p2, s13[:, :INTER], s2)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_w8a8_writer_quantizes_every_linear_but_routers_and_lm_head(tmp_path, family):
    import json

    from safetensors.torch import load_file

    from eplb_graph.models.tiny_w8a8 import write_float_checkpoint, write_tiny_w8a8

    source = load_file(write_float_checkpoint(tmp_path / "f", family) / "model.safetensors")
    model = write_tiny_w8a8(tmp_path / "q", family)
    quantized = load_file(model / "model.safetensors")
    config = json.loads((model / "config.json").read_text())["quantization_config"]
    assert config["format"] == "int-quantized" and "lm_head" in config["ignore"]
    experts = [name for name in source if ".experts." in name]
    assert len(experts) == 2 * 8 * 3
    for name, weight in source.items():
        q = quantized[name]
        if (
            name.endswith(("gate.weight", "lm_head.weight", "embed_tokens.weight"))
            or weight.dim() < 2
        ):
            assert torch.equal(q, weight), name
            continue
        scale = quantized[f"{name}_scale"]
        assert q.dtype == torch.int8 and scale.shape == (weight.shape[0], 1), name
        assert int(q.abs().amax(dim=1).min()) == 127  # symmetric, full range per channel
        assert (q.float() * scale - weight).abs().max() <= scale.max() / 2 + 1e-7


def test_eplb_is_lifted_for_the_int8_cpu_experts_only_and_the_gate_follows_the_cpu():
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w8a8_int8 as ct_int8,
    )

    from eplb_graph.integrations.vllm import quantized

    quantized.install()
    quantized.install()  # idempotent: nothing wrapped twice
    method = object.__new__(ct_int8.CompressedTensorsW8A8Int8MoEMethod)
    method.experts_cls = cpu_moe.CPUExpertsInt8
    assert method.supports_eplb is True
    method.experts_cls = cpu_moe.ZenCPUExpertsInt8  # a kernel whose weights nothing moves
    assert method.supports_eplb is False
    supported = cpu_moe.CPUExpertsInt8._supports_current_device()
    expected = torch.cpu._is_amx_tile_supported() or quantized.avx512_vnni_bf16_capable()
    assert supported == expected


def _moved_experts():
    *_, s13, s2, p13, p2 = _int8_experts(3)
    return {"w13": p13, "w2": p2, "w13_scale": s13, "w2_scale": s2}


@needs_kernel
def test_the_digest_check_passes_when_scales_move_with_their_weights():
    assert problems_after_move(_moved_experts(), ("w13", "w2", "w13_scale", "w2_scale")) == []


@needs_kernel
def test_a_planted_mismatch_scales_left_behind_fails_the_digest_check():
    """Weights move, scales stay: every slot whose expert changed has the right weights next
    to another expert's scales."""
    problems = problems_after_move(_moved_experts(), ("w13", "w2"))
    assert len(problems) == CHANGED_SLOTS > 0, problems


# -- real engines ---------------------------------------------------------------------------------

CHECKPOINTS = {
    # name: (family, quantization): two families, vLLM's two int8 MoE methods, 4 engines
    "qwen3_ct": ("qwen3_moe", "compressed-tensors"),
    "mixtral_online": ("mixtral", "experts_int8"),
}


@pytest.fixture(scope="module")
def quantized_engines(tmp_path_factory):
    """``start(checkpoint, mode)``: each engine started once, one at a time (2 cores)."""
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    from test_vllm_engine import EPLB, metrics, run_engine

    from eplb_graph.models.tiny_w8a8 import write_float_checkpoint, write_tiny_w8a8

    root = tmp_path_factory.mktemp("w8a8")
    cache: dict[tuple[str, str], dict] = {}

    def start(checkpoint: str, mode: str) -> dict:
        key = (checkpoint, mode)
        if key in cache:
            return cache[key]
        family, quantization = CHECKPOINTS[checkpoint]
        model = root / checkpoint
        if not model.exists():
            if quantization == "experts_int8":
                write_float_checkpoint(model, family)
            else:
                write_tiny_w8a8(model, family)
        name = f"{checkpoint}-{mode}"
        section = {"metrics_path": str(root / f"metrics-{name}"), "rearrange": "always"}
        if mode == "fixed":  # record mode: plans are written, never applied
            section["record_map_path"] = str(root / f"{name}-map.json")
        else:
            section["weight_digests"] = True
        llm = {
            "dtype": "bfloat16",
            "tensor_parallel_size": 2,
            "enable_expert_parallel": True,
            "enforce_eager": True,
            "enable_eplb": True,
            "eplb_config": {**EPLB, "use_async": False},
            "additional_config": {"eplb_graph": section},
        }
        if quantization == "experts_int8":
            llm["quantization"] = "experts_int8"
        result = run_engine(root, name, model, llm)
        result["metrics"] = metrics(root / f"metrics-{name}")
        cache[key] = result
        return result

    return start


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
@needs_kernel
def test_w8a8_tokens_with_eplb_equal_the_same_layout_with_eplb_off(quantized_engines, checkpoint):
    """Top-2 on 2 ranks: a token's output is its two bf16 expert rows added and rounded once,
    whichever ranks compute them, so the placement changes no token."""
    fixed = quantized_engines(checkpoint, "fixed")
    for rank in fixed["metrics"]:
        assert rank["layers_committed"] == 0 and rank["plans_recorded"] >= 2, rank
    tokens = fixed["tokens"][0]
    assert len(tokens) == 4 and all(len(t) == 64 for t in tokens)
    assert len({tuple(t) for t in tokens}) > 1  # the model is not degenerate
    assert quantized_engines(checkpoint, "eplb")["tokens"] == fixed["tokens"]


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
@needs_kernel
def test_w8a8_rearrangements_move_whole_experts(quantized_engines, checkpoint):
    """>= 2 rearrangements on one placement; after every commit each slot's packed bytes,
    compensation and scales are exactly those of the expert the placement names."""
    per_rank = quantized_engines(checkpoint, "eplb")["metrics"]
    initial = quantized_engines(checkpoint, "fixed")["metrics"][0]["placement_digest"]
    for rank in per_rank:
        assert rank["rearrangements"] >= 2 and rank["layers_committed"] >= 2, rank
        assert rank["aborted"] == 0 and rank["last_error"] is None, rank
        assert rank["placement_digest"] != initial
    assert len({rank["placement_digest"] for rank in per_rank}) == 1
    checked, problems = check_slot_digests(per_rank)
    assert problems == []
    # a record per committed placement change (>= one per rearrangement), on every rank
    assert checked >= sum(rank["rearrangements"] for rank in per_rank)


def test_weight_digests_are_refused_without_a_metrics_path(tmp_path):
    from eplb_graph.integrations.settings import ConfigError
    from eplb_graph.integrations.vllm.options import PluginOptions

    with pytest.raises(ConfigError, match=r"weight_digests.*needs metrics_path"):
        PluginOptions.from_section({"weight_digests": True})
    options = PluginOptions.from_section({"weight_digests": True, "metrics_path": str(tmp_path)})
    assert options.weight_digests is True
    with pytest.raises(ConfigError, match="weight_digests"):
        PluginOptions.from_section({"weight_digests": "yes", "metrics_path": str(tmp_path)})
