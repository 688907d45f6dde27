"""W4A16 int4 experts under vLLM (0.32, CPU backend) with expert parallelism and EPLB.

Unit part (vLLM's int4 CPU kernel called directly, no engine): vLLM's repacking of int4 groups
is per expert; the local-rows op on the int4 kernel (two ranks' halves) sums to the kernel on
every row, and the kernel equals a dequantized reference on this CPU; the ``cpu_int4_packed``
view moves weights, scales and zero points together and refuses tensors of another layout;
EPLB is lifted for ``CPUExpertsInt4`` only; the checkpoint writer's packing is compressed-tensors'.

Engine part: a Qwen3-MoE whose experts are W4A16 (compressed-tensors ``pack-quantized``, group
64, written by ``eplb_graph.models.tiny_w4a16``), served in bfloat16 with TP=2 + expert
parallelism and 2 redundant slots, **compiled**, both engines in one process: the same layout
with EPLB off (record mode) and EPLB on (synchronous) with ``weight_digests``. Asserted: identical
tokens, at least 2 rearrangements committed on one placement on both ranks, no graph break and
no recompile after the first step, and after every commit every local slot's blocked int4 bytes,
scales and zero points equal those of the expert the placement names.
"""

from __future__ import annotations

import pytest
import torch
from quantized_moves import CHANGED_SLOTS, needs_kernels, problems_after_move

from eplb_graph.integrations.vllm.local_rows import vllm_local_experts
from eplb_graph.integrations.vllm.slot_digests import check_slot_digests
from eplb_graph.movement.views import CpuInt4PackedView, UnsupportedWeightFormat, make_expert_view

ops = pytest.importorskip("vllm._custom_ops", reason="the vllm extra is not installed")

pytestmark = pytest.mark.vllm
needs_kernel = needs_kernels("int4", ("fused_experts_cpu", "convert_weight_packed_scale_zp"))

E, H, INTER, K, GROUP = 8, 128, 64, 2, 64


def _pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int4 ``[E, rows, cols]`` in [-8, 7] -> compressed-tensors' int32 ``[E, rows, cols / 8]``."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    return pack_to_int32(q.to(torch.int8), 4)


def _int4_experts(seed: int = 0):
    """Random int4 experts (N-first, as checkpoints store them), their bf16 group scales, and
    vLLM's CPU repacking of them (GPTQ algorithm, symmetric: synthesised zero points)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
        prepare_int4_moe_layer_for_cpu,
    )

    gen = torch.Generator().manual_seed(seed)
    q13 = torch.randint(-8, 8, (E, 2 * INTER, H), generator=gen)
    q2 = torch.randint(-8, 8, (E, H, INTER), generator=gen)
    s13 = (torch.rand(E, 2 * INTER, H // GROUP, generator=gen) * 0.02 + 0.01).bfloat16()
    s2 = (torch.rand(E, H, INTER // GROUP, generator=gen) * 0.02 + 0.01).bfloat16()
    blocked = prepare_int4_moe_layer_for_cpu(
        _pack_rows(q13).transpose(1, 2).contiguous(),
        _pack_rows(q2).transpose(1, 2).contiguous(),
        s13.transpose(1, 2).contiguous(),
        s2.transpose(1, 2).contiguous(),
    )
    w13 = q13.float() * s13.float().repeat_interleave(GROUP, dim=2)
    w2 = q2.float() * s2.float().repeat_interleave(GROUP, dim=2)
    return (w13, w2), (q13, q2, s13, s2), blocked


def _quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token symmetric int8, dequantized (what the W4A8 kernel does to activations)."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / 127
    return torch.round(x / scale).clamp(-127, 127) * scale


def _reference(hidden, ids, weights, w13, w2):
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(hidden.shape[0]):
        x = _quantize_rows(hidden[t].float())
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (w13[e] @ x).chunk(2)
            h = _quantize_rows(torch.nn.functional.silu(gate) * up)
            out[t] += weights[t, k] * (w2[e] @ h)
    return out


@needs_kernel
def test_vllm_repacks_int4_experts_one_by_one():
    _, (q13, q2, s13, s2), blocked = _int4_experts(1)
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
        prepare_int4_moe_layer_for_cpu,
    )

    for e in (0, 5):
        alone = prepare_int4_moe_layer_for_cpu(
            _pack_rows(q13[e : e + 1]).transpose(1, 2).contiguous(),
            _pack_rows(q2[e : e + 1]).transpose(1, 2).contiguous(),
            s13[e : e + 1].transpose(1, 2).contiguous(),
            s2[e : e + 1].transpose(1, 2).contiguous(),
        )
        for whole, part in zip(blocked, alone, strict=True):
            assert torch.equal(whole[e], part[0])


@pytest.mark.parametrize("tokens", [1, 9, 40])
@needs_kernel
def test_int4_local_rows_of_two_ranks_sum_to_the_kernel_on_every_row(tokens):
    (w13, w2), _, (b13, b2, bs13, bs2, bz13, bz2) = _int4_experts(tokens)
    gen = torch.Generator().manual_seed(7 + tokens)
    hidden = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, E, (tokens, K), generator=gen, dtype=torch.int32)
    weights = torch.rand(tokens, K, generator=gen)
    whole = torch.empty_like(hidden)
    ops.fused_experts_cpu(
        whole, hidden, b13, b2, weights, ids, ops.CPUQuantMethod.INT4_W4A8, bs13, bs2, bz13, bz2,
        None, None, None, None, None, True,
    )  # fmt: skip
    total = torch.zeros(tokens, H)
    rows = 0
    for rank in range(2):
        local = slice(4 * rank, 4 * rank + 4)
        expert_map = torch.full((E,), -1, dtype=torch.int32)
        expert_map[local] = torch.arange(4, dtype=torch.int32)
        stats = torch.zeros(2, dtype=torch.int64)
        tensors = [t[local] for t in (b13, b2, bs13, bs2, bz13, bz2)]
        part = vllm_local_experts(hidden, ids, weights, expert_map, tensors, stats, "cpu_int4_w4a8")
        rows += int(stats[0])
        total += part.float()
    assert rows == tokens * K
    reference = _reference(hidden, ids, weights, w13, w2)
    scale = reference.abs().max()
    # bf16 output rounding on both sides; the int8 arithmetic itself is exact
    assert (total - whole.float()).abs().max() <= 0.02 * scale
    assert (whole.float() - reference).abs().max() <= 0.05 * scale


@needs_kernel
def test_the_int4_kernel_refuses_weight_on_input_and_other_activations():
    from eplb_graph.integrations.vllm.local_rows import LocalRowsError

    _, _, blocked = _int4_experts(2)
    hidden = torch.randn(3, H).to(torch.bfloat16)
    ids = torch.zeros(3, 1, dtype=torch.int32)
    expert_map = torch.arange(E, dtype=torch.int32)
    stats = torch.zeros(2, dtype=torch.int64)
    for activation, on_input in (("gelu", False), ("silu", True)):
        with pytest.raises(LocalRowsError, match="int4 CPU kernel"):
            vllm_local_experts(
                hidden, ids, torch.ones(3, 1), expert_map, list(blocked), stats,
                "cpu_int4_w4a8", activation, "", on_input,
            )  # fmt: skip


@needs_kernel
def test_the_view_moves_weights_scales_and_zero_points_together():
    _, _, blocked = _int4_experts(3)
    names = ("w13", "w2", "w13_scale", "w2_scale", "w13_zp", "w2_zp")
    tensors = {name: t.clone() for name, t in zip(names, blocked, strict=True)}
    for name in ("w13_zp", "w2_zp"):  # symmetric: all 8; make each slot's distinct to see it move
        tensors[name].random_(-8, 8, generator=torch.Generator().manual_seed(5))
    view = make_expert_view("cpu_int4_packed", tensors)
    assert isinstance(view, CpuInt4PackedView)
    assert view.slot_nbytes >= sum(t[0].numel() * t.element_size() for t in tensors.values())
    payload = torch.empty(view.slot_nbytes, dtype=torch.uint8)
    view.pack_slot(5, payload)
    view.unpack_slot_(0, payload)
    for name in names:
        assert torch.equal(tensors[name][0], tensors[name][5]), name
        assert not torch.equal(tensors[name][1], tensors[name][5]), name  # slots are distinct


@needs_kernel
def test_the_view_refuses_unblocked_weights_and_mismatched_zero_points():
    _, (q13, *_), (b13, b2, bs13, bs2, bz13, bz2) = _int4_experts(4)
    with pytest.raises(UnsupportedWeightFormat, match="4-D"):
        CpuInt4PackedView(_pack_rows(q13), b2, bs13, bs2, bz13, bz2)
    with pytest.raises(UnsupportedWeightFormat, match="one shape"):
        CpuInt4PackedView(b13, b2, bs13, bs2, bz13[..., :16], bz2)
    with pytest.raises(UnsupportedWeightFormat, match="dtype"):
        CpuInt4PackedView(b13, b2, bs13.bfloat16(), bs2, bz13, bz2)
    with pytest.raises(UnsupportedWeightFormat, match="tiles"):
        CpuInt4PackedView(b13, b2, bs2, bs13, bz2, bz13)


def test_eplb_is_lifted_for_the_int4_cpu_experts_only_and_the_gate_follows_the_cpu():
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as ct_wna16,
    )

    from eplb_graph.integrations.vllm import quantized

    quantized.install()
    quantized.install()  # idempotent: nothing wrapped twice
    method = object.__new__(ct_wna16.CompressedTensorsWNA16MoEMethod)
    method.experts_cls = cpu_moe.CPUExpertsInt4
    method.wna16_backend = WNA16MoEBackend.CPU
    assert method.supports_eplb is True
    method.experts_cls = cpu_moe.CPUExpertsInt8  # not what this method's weights are
    assert method.supports_eplb is False
    method.wna16_backend = WNA16MoEBackend.TRITON  # vLLM's own answer still stands
    assert method.supports_eplb is True
    from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQMoEMethod

    gptq = object.__new__(AutoGPTQMoEMethod)
    gptq.experts_cls = cpu_moe.CPUExpertsInt4
    assert gptq.supports_eplb is True
    gptq.experts_cls = cpu_moe.CPUExpertsInt8
    assert gptq.supports_eplb is False
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQMoEMethod

    awq = object.__new__(AutoAWQMoEMethod)
    awq.experts_cls = cpu_moe.CPUExpertsInt4
    assert awq.supports_eplb is True
    awq.experts_cls = None
    assert awq.supports_eplb is False
    supported = cpu_moe.CPUExpertsInt4._supports_current_device()
    expected = torch.cpu._is_amx_tile_supported() or quantized.avx512_vnni_bf16_capable()
    assert supported == expected


def test_the_w4a16_writer_packs_expert_groups_as_compressed_tensors_reads_them(tmp_path):
    import json

    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    from eplb_graph.models.tiny_qwen3_moe import write_tiny_qwen3_moe
    from eplb_graph.models.tiny_w4a16 import write_tiny_w4a16

    source = load_file(write_tiny_qwen3_moe(tmp_path / "f") / "model.safetensors")
    model = write_tiny_w4a16(tmp_path / "q")
    quantized = load_file(model / "model.safetensors")
    config = json.loads((model / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized"
    assert config["config_groups"]["group_0"]["weights"]["group_size"] == GROUP
    experts = [name for name in source if ".experts." in name]
    assert len(experts) == 2 * 8 * 3
    for name, weight in source.items():
        if name not in experts:
            assert torch.equal(quantized[name], weight), name
            continue
        stem = name[: -len(".weight")]
        shape = torch.Size(quantized[f"{stem}.weight_shape"].tolist())
        assert shape == weight.shape
        q = unpack_from_int32(quantized[f"{stem}.weight_packed"], 4, shape)
        scale = quantized[f"{stem}.weight_scale"]
        assert scale.dtype == torch.bfloat16 and scale.shape == (shape[0], shape[1] // GROUP)
        assert int(q.min()) >= -8 and int(q.max()) <= 7
        dequantized = q.float() * scale.float().repeat_interleave(GROUP, dim=1)
        error = (dequantized - weight).abs().max()
        assert error <= scale.float().max() * 0.51  # half a step (bf16 scale rounding aside)


@pytest.mark.parametrize("moved", ["all", "weights only", "no zero points"])
@needs_kernel
def test_the_digest_check_catches_int4_scales_or_zero_points_left_behind(moved):
    """Two ranks of 5 slots move to a new placement; a view that forgets the scales (or the
    zero points, made distinct per expert here: symmetric checkpoints have all 8) fails."""
    _, _, blocked = _int4_experts(6)
    names = ("w13", "w2", "w13_scale", "w2_scale", "w13_zp", "w2_zp")
    experts = {name: t.clone() for name, t in zip(names, blocked, strict=True)}
    for name in ("w13_zp", "w2_zp"):
        experts[name].random_(-8, 8, generator=torch.Generator().manual_seed(9))
    moved = {"all": names, "weights only": names[:2], "no zero points": names[:4]}[moved]
    problems = problems_after_move(experts, moved)
    assert len(problems) == (0 if moved == names else CHANGED_SLOTS), problems


def test_the_gptq_writer_packs_along_the_input_with_gptqs_zero_point_convention(tmp_path):
    import json

    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    from eplb_graph.models.tiny_qwen3_moe import write_tiny_qwen3_moe
    from eplb_graph.models.tiny_w4a16 import write_tiny_w4a16

    source = load_file(write_tiny_qwen3_moe(tmp_path / "f") / "model.safetensors")
    model = write_tiny_w4a16(tmp_path / "q", checkpoint_format="gptq")
    quantized = load_file(model / "model.safetensors")
    config = json.loads((model / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "gptq" and config["desc_act"] is False
    name = "model.layers.1.mlp.experts.3.down_proj"
    weight = source[f"{name}.weight"]  # [out, in]
    out_features, in_features = weight.shape
    qweight = quantized[f"{name}.qweight"]
    assert qweight.dtype == torch.int32 and qweight.shape == (in_features // 8, out_features)
    q = unpack_from_int32(qweight, 4, torch.Size([in_features, out_features]), packed_dim=0)
    scales = quantized[f"{name}.scales"]
    assert scales.dtype == torch.float16 and scales.shape == (in_features // GROUP, out_features)
    dequantized = q.float() * scales.float().repeat_interleave(GROUP, dim=0)
    assert (dequantized - weight.t()).abs().max() <= scales.float().max() * 0.51
    zeros = quantized[f"{name}.qzeros"]  # GPTQ stores zero point 8 as 7 in every nibble
    assert zeros.shape == (in_features // GROUP, out_features // 8)
    assert bool((zeros == 0x77777777).all())
    assert torch.equal(quantized[f"{name}.g_idx"], torch.arange(in_features) // GROUP)
    assert torch.equal(quantized["model.layers.0.self_attn.q_proj.weight"],
                       source["model.layers.0.self_attn.q_proj.weight"])  # fmt: skip


@needs_kernel
def test_awq_checkpoints_are_read_by_vllm_as_written_and_keep_per_expert_zero_points():
    """The AWQ writer's tensors (output-packed in AWQ's nibble order, asymmetric zero points),
    stacked as ``AutoAWQMoEMethod`` loads them and repacked by vLLM's CPU AWQ path: the kernel
    equals ``(q - zero) * scale``; the blocked zero points differ by expert, so an expert's
    zero points left behind would show in the digests."""
    from vllm._custom_ops import CPUQuantAlgo
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
        prepare_int4_moe_layer_for_cpu,
    )

    from eplb_graph.models.tiny_w4a16 import _awq_tensors, quantize_uint4_groups

    gen = torch.Generator().manual_seed(11)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen) * 0.1  # [out = gate + up, in]
    w2 = torch.randn(E, H, INTER, generator=gen) * 0.1
    stacked: dict[str, list] = {}
    dequantized = []
    for matrix in (w13, w2):
        parts = [_awq_tensors("x", matrix[e], GROUP) for e in range(E)]
        for name in ("qweight", "qzeros", "scales"):
            stacked.setdefault(name, []).append(torch.stack([p[f"x.{name}"] for p in parts]))
        rows = []
        for e in range(E):
            q, zero, scale = quantize_uint4_groups(matrix[e], GROUP)
            step = scale.float().repeat_interleave(GROUP, dim=1)
            rows.append((q.float() - zero.float().repeat_interleave(GROUP, dim=1)) * step)
        dequantized.append(torch.stack(rows))
    (q13, q2), (z13, z2), (s13, s2) = (stacked[n] for n in ("qweight", "qzeros", "scales"))
    b13, b2, bs13, bs2, bz13, bz2 = prepare_int4_moe_layer_for_cpu(
        q13, q2, s13.bfloat16(), s2.bfloat16(), CPUQuantAlgo.AWQ, z13, z2
    )
    hidden = torch.randn(12, H, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, E, (12, K), generator=gen, dtype=torch.int32)
    weights = torch.rand(12, K, generator=gen)
    out = torch.empty_like(hidden)
    ops.fused_experts_cpu(
        out, hidden, b13, b2, weights, ids, ops.CPUQuantMethod.INT4_W4A8, bs13, bs2, bz13, bz2,
        None, None, None, None, None, True,
    )  # fmt: skip
    reference = _reference(hidden, ids, weights, *dequantized)
    assert (out.float() - reference).abs().max() <= 0.05 * reference.abs().max()
    assert len({bytes(bz13[e].flatten().view(torch.uint8).tolist()) for e in range(E)}) == E


# -- real engines ---------------------------------------------------------------------------------


CHECKPOINTS = {
    # name: (checkpoint format, compiled): vLLM's two W4A16 MoE methods that reach CPUExpertsInt4
    "ct": ("compressed-tensors", True),  # CompressedTensorsWNA16MoEMethod
    "gptq": ("gptq", False),  # AutoGPTQMoEMethod
    "awq": ("awq", False),  # AutoAWQMoEMethod: asymmetric, zero points differ by expert
}


@pytest.fixture(scope="module")
def w4a16_engines(request, tmp_path_factory):
    """``checkpoint -> {"fixed", "eplb"}``: the engines of every checkpoint the selected tests
    ask for, all in one process, one after another (2 cores; one vLLM import for all)."""
    from test_vllm_engine import EPLB, MAX_TOKENS, PROMPTS, metrics, run_scenario

    from eplb_graph.models.tiny_w4a16 import write_tiny_w4a16

    selected = {
        item.callspec.params.get("checkpoint")
        for item in request.session.items
        if item.module is request.module and getattr(item, "callspec", None) is not None
    } & set(CHECKPOINTS)
    root = tmp_path_factory.mktemp("w4a16")
    engines = []
    for checkpoint in sorted(selected):
        checkpoint_format, compiled = CHECKPOINTS[checkpoint]
        model = write_tiny_w4a16(root / checkpoint, checkpoint_format=checkpoint_format)
        for mode in ("fixed", "eplb"):
            name = f"{checkpoint}-{mode}"
            section = {"metrics_path": str(root / f"metrics-{name}"), "rearrange": "always"}
            if mode == "fixed":  # record mode: plans are written, never applied
                section["record_map_path"] = str(root / f"{name}-map.json")
            else:
                section["weight_digests"] = True
            llm = {
                "skip_tokenizer_init": True,
                "dtype": "bfloat16",
                "max_model_len": 128,
                "max_num_seqs": 4,
                "max_num_batched_tokens": 128,
                "seed": 0,
                "tensor_parallel_size": 2,
                "enable_expert_parallel": True,
                "enforce_eager": not compiled,  # compiled: the int4 op traces in as one node
                "enable_eplb": True,
                "eplb_config": {**EPLB, "use_async": False},
                "additional_config": {"eplb_graph": section},
            }
            engines.append(
                {
                    "name": name,
                    "model": str(model),
                    "prompts": PROMPTS,
                    "llm": llm,
                    "max_tokens": MAX_TOKENS,
                    "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                }
            )
    results = run_scenario(root, "families", {"engines": engines}, len(engines)) if engines else {}
    served: dict[str, dict] = {}
    for name, result in results.items():
        if "error" in result:
            log = (root / "families.log").read_text()[-3000:]
            pytest.fail(f"the W4A16 engine {name} failed: {result['error']}\n{log}")
        result["metrics"] = metrics(root / f"metrics-{name}")
        checkpoint, mode = name.rsplit("-", 1)
        served.setdefault(checkpoint, {})[mode] = result
    return served.__getitem__


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
@needs_kernel
def test_w4a16_tokens_with_eplb_equal_the_same_layout_with_eplb_off(w4a16_engines, checkpoint):
    engines = w4a16_engines(checkpoint)
    fixed = engines["fixed"]
    for rank in fixed["metrics"]:
        assert rank["layers_committed"] == 0 and rank["plans_recorded"] >= 2, rank
    tokens = fixed["tokens"][0]
    assert len(tokens) == 4 and all(len(t) == 64 for t in tokens)
    assert len({tuple(t) for t in tokens}) > 1  # the model is not degenerate
    assert engines["eplb"]["tokens"] == fixed["tokens"]


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
@needs_kernel
def test_w4a16_rearrangements_move_whole_experts(w4a16_engines, checkpoint):
    engines = w4a16_engines(checkpoint)
    per_rank = engines["eplb"]["metrics"]
    initial = engines["fixed"]["metrics"][0]["placement_digest"]
    for rank in per_rank:
        assert rank["rearrangements"] >= 2 and rank["layers_committed"] >= 2, rank
        assert rank["aborted"] == 0 and rank["last_error"] is None, rank
        assert rank["placement_digest"] != initial
    assert len({rank["placement_digest"] for rank in per_rank}) == 1
    checked, problems = check_slot_digests(per_rank)
    assert problems == []
    assert checked >= sum(rank["rearrangements"] for rank in per_rank)
    if CHECKPOINTS[checkpoint][1]:  # compiled: one graph, commits in place, no recompile
        for rank in per_rank:
            compiled = rank["compile"]
            assert compiled["graph_breaks"] == 0 and compiled["unique_graphs"] >= 1, compiled
            assert compiled["unique_graphs"] == compiled["unique_graphs_at_first_step"], compiled
    experts = {}  # layer 0's expert -> digest, from every rank's slots at attach
    for rank in per_rank:
        initial_record = rank["weight_digests"]["initial"]
        local = initial_record["slots"][0]
        phy2log = initial_record["phy2log"][0]
        first = rank["rank"] * len(local)
        for slot, digest in enumerate(local):
            experts[phy2log[first + slot]] = digest
    assert len(experts) == 8 and len(set(experts.values())) == 8  # the check can tell them apart
