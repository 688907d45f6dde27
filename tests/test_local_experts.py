"""``torch.ops.eplb_graph.local_experts`` / ``local_experts_w8a8``: one EP rank's expert work.

What must hold: the native CPU kernel equals the ATen oracle on random shapes (slots -1, other
ranks' slots, replicas, padding rows, every dtype, weight on input); it computes exactly the local
valid rows (``stats[0]``) and times itself (``stats[1]``); a row's result does not depend on the
other rows of the batch (so EPLB on and off give identical outputs); two ranks' shares add up to
the whole layer; opcheck; ``fullgraph=True`` with no break and no recompile when weights or the
slot map change in place; the fake kernel refuses bad inputs with a typed message.
"""

from __future__ import annotations

import pytest
import torch

from eplb_graph import ops
from eplb_graph.ops import native

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def _native_kernel():
    assert native.ensure_loaded(), native.failure_reason()


def make_layer(seed, rows, hidden, inter, experts, top_k, slots, dtype, w8a8=False):
    """Random inputs: a rank holding ``experts`` local rows among ``slots`` physical slots
    (local rows 0..E-1 in the first E slots, replicas of them in the next ones, the rest remote);
    slot ids include -1 and out-of-range values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    ids = torch.randint(-1, slots + 1, (rows, top_k), generator=g)
    weights = torch.rand(rows, top_k, generator=g)
    slot_to_local = torch.full((slots,), -1, dtype=torch.int64)
    local = min(slots, experts + experts // 2)
    slot_to_local[:local] = torch.arange(local) % experts  # replicas share a local row's expert
    if w8a8:
        w13 = torch.randint(-127, 128, (experts, 2 * inter, hidden), generator=g, dtype=torch.int8)
        w2 = torch.randint(-127, 128, (experts, hidden, inter), generator=g, dtype=torch.int8)
        scales = (
            torch.rand(experts, 2 * inter, generator=g) / 500,
            torch.rand(experts, hidden, generator=g) / 500,
        )
        return x.float(), ids, weights, slot_to_local, w13, w2, scales
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    return x, ids, weights, slot_to_local, w13, w2, ()


def expected_rows(ids, slot_to_local, experts, valid):
    inside = (ids >= 0) & (ids < slot_to_local.shape[0])
    local = slot_to_local[ids.clamp(0, slot_to_local.shape[0] - 1)]
    counted = inside & (local >= 0) & (local < experts)
    counted[valid:] = False
    return int(counted.sum())


def run_both(args, scales, valid, weight_on_input):
    x, ids, weights, slot_to_local, w13, w2 = args
    stats_native = torch.zeros(2, dtype=torch.int64)
    stats_ref = torch.zeros(2, dtype=torch.int64)
    nv = torch.tensor(valid)
    if scales:
        native_out = ops.local_experts_w8a8(
            x, ids, weights, slot_to_local, w13, w2, *scales, stats_native, nv, weight_on_input
        )
        ref_out = ops.local_experts_w8a8_ref(
            x, ids, weights, slot_to_local, w13, w2, *scales, stats_ref, nv, weight_on_input
        )
    else:
        native_out = ops.local_experts(
            x, ids, weights, slot_to_local, w13, w2, stats_native, nv, weight_on_input
        )
        ref_out = ops.local_experts_ref(
            x, ids, weights, slot_to_local, w13, w2, stats_ref, nv, weight_on_input
        )
    return native_out, ref_out, stats_native, stats_ref


@pytest.mark.parametrize("weight_on_input", [False, True])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("seed", range(4))
def test_native_equals_oracle(seed, dtype, weight_on_input):
    g = torch.Generator().manual_seed(100 + seed)
    rows, hidden, inter = (int(v) for v in torch.randint(1, 40, (3,), generator=g))
    experts, top_k = (
        int(torch.randint(1, 6, (1,), generator=g)),
        int(torch.randint(1, 5, (1,), generator=g)),
    )
    slots = experts * 3
    *args, scales = make_layer(seed, rows, hidden, inter, experts, top_k, slots, DTYPES[dtype])
    valid = int(torch.randint(0, rows + 2, (1,), generator=g))  # may exceed T: clamped
    native_out, ref_out, stats_native, stats_ref = run_both(args, scales, valid, weight_on_input)
    assert native_out.dtype == ref_out.dtype == DTYPES[dtype]
    assert native_out.shape == (rows, hidden)
    torch.testing.assert_close(
        native_out.float(),
        ref_out.float(),
        atol=TOLERANCE[DTYPES[dtype]],
        rtol=TOLERANCE[DTYPES[dtype]],
    )
    local_rows = expected_rows(args[1], args[3], experts, valid)
    assert int(stats_native[0]) == int(stats_ref[0]) == local_rows
    assert int(stats_native[1]) > 0 or local_rows == 0
    assert native_out[min(valid, rows) :].abs().sum() == 0  # padding rows untouched: zero


@pytest.mark.parametrize("weight_on_input", [False, True])
def test_w8a8_native_equals_oracle(weight_on_input):
    *args, scales = make_layer(7, 33, 40, 24, 4, 3, 12, torch.float32, w8a8=True)
    native_out, ref_out, stats_native, stats_ref = run_both(args, scales, 30, weight_on_input)
    torch.testing.assert_close(native_out, ref_out, atol=1e-4, rtol=1e-4)
    assert int(stats_native[0]) == int(stats_ref[0]) == expected_rows(args[1], args[3], 4, 30)


def test_only_local_rows_are_computed_and_stats_accumulate():
    """Half the rows live on another rank: the kernel computes the other half only, and
    ``stats`` adds up over calls (the runtime reads deltas)."""
    *args, _ = make_layer(3, 64, 16, 8, 4, 2, 8, torch.float32)
    x, _, weights, _, w13, w2 = args
    ids = torch.arange(128).reshape(64, 2) % 8  # slots 0..7, each row one local and one remote
    slot_to_local = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1])
    stats = torch.zeros(2, dtype=torch.int64)
    for call in (1, 2):
        ops.local_experts(x, ids, weights, slot_to_local, w13, w2, stats, torch.tensor(64))
        assert int(stats[0]) == call * 64
    nothing_local = torch.full((8,), -1)
    before = stats.clone()
    out = ops.local_experts(x, ids, weights, nothing_local, w13, w2, stats, torch.tensor(64))
    assert out.abs().sum() == 0 and int(stats[0]) == int(before[0])


def test_two_ranks_add_up_to_the_whole_layer():
    """EP=2: rank 0 holds slots 0..3, rank 1 slots 4..7; their outputs sum to one rank holding
    all eight, and each computes only its own rows."""
    *args, _ = make_layer(5, 48, 24, 16, 8, 4, 8, torch.float32)
    x, ids, weights, _, w13, w2 = args
    ids = ids.clamp(0, 7)
    everything = torch.arange(8)
    rank_maps = [
        torch.tensor([0, 1, 2, 3, -1, -1, -1, -1]),
        torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3]),
    ]
    rank_weights = [(w13[:4], w2[:4]), (w13[4:], w2[4:])]
    nv = torch.tensor(48)
    whole_stats = torch.zeros(2, dtype=torch.int64)
    whole = ops.local_experts(x, ids, weights, everything, w13, w2, whole_stats, nv)
    total = torch.zeros_like(whole)
    rows = []
    for slot_to_local, (a, b) in zip(rank_maps, rank_weights, strict=True):
        stats = torch.zeros(2, dtype=torch.int64)
        total += ops.local_experts(x, ids, weights, slot_to_local, a, b, stats, nv)
        rows.append(int(stats[0]))
    torch.testing.assert_close(total, whole, atol=1e-5, rtol=1e-5)
    assert sum(rows) == int(whole_stats[0]) == 48 * 4
    assert rows == [int((ids < 4).sum()), int((ids >= 4).sum())]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_row_results_do_not_depend_on_the_batch(dtype):
    """A token's output is bit-identical alone, in a batch, or with its rows split over two
    calls by k: the property that keeps EPLB-on outputs equal to EPLB-off ones."""
    *args, _ = make_layer(11, 40, 32, 24, 4, 2, 4, DTYPES[dtype])
    x, ids, weights, slot_to_local, w13, w2 = args
    ids = ids.clamp(0, 3)
    stats = torch.zeros(2, dtype=torch.int64)
    batch = ops.local_experts(x, ids, weights, slot_to_local, w13, w2, stats, torch.tensor(40))
    for t in (0, 17, 39):
        alone = ops.local_experts(
            x[t : t + 1],
            ids[t : t + 1],
            weights[t : t + 1],
            slot_to_local,
            w13,
            w2,
            stats,
            torch.tensor(1),
        )
        assert torch.equal(alone[0], batch[t])


def test_opcheck_every_expert_op():
    for w8a8 in (False, True):
        for rows, valid in ((0, 0), (1, 1), (16, 12)):
            *args, scales = make_layer(rows, rows, 16, 8, 3, 2, 6, torch.float32, w8a8=w8a8)
            x, ids, weights, slot_to_local, w13, w2 = args
            stats = torch.zeros(2, dtype=torch.int64)
            name = "local_experts_w8a8" if w8a8 else "local_experts"
            inputs = (
                x,
                ids,
                weights,
                slot_to_local,
                w13,
                w2,
                *scales,
                stats,
                torch.tensor(valid),
                False,
            )
            result = torch.library.opcheck(ops.op_handles()[name], inputs)
            assert set(result.values()) == {"SUCCESS"}, result


def test_fullgraph_compile_no_break_no_recompile_on_in_place_changes():
    import torch._dynamo.testing

    *args, _ = make_layer(2, 16, 16, 8, 4, 2, 8, torch.float32)
    x, ids, weights, slot_to_local, w13, w2 = args
    stats = torch.zeros(2, dtype=torch.int64)
    nv = torch.tensor(16)

    def layer(x, ids, weights, slot_to_local, w13, w2, stats, nv):
        return x + ops.local_experts(x, ids, weights, slot_to_local, w13, w2, stats, nv)

    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    eager = layer(x, ids, weights, slot_to_local, w13, w2, stats.clone(), nv)
    torch.testing.assert_close(compiled(x, ids, weights, slot_to_local, w13, w2, stats, nv), eager)
    assert int(stats[0]) == expected_rows(ids, slot_to_local, 4, 16)
    # A commit: new weights and a new slot map written in place; the graph sees them.
    w13.copy_(torch.flip(w13, dims=[0]))
    slot_to_local.copy_(torch.roll(slot_to_local, 1))
    eager = layer(x, ids, weights, slot_to_local, w13, w2, torch.zeros(2, dtype=torch.int64), nv)
    torch.testing.assert_close(compiled(x, ids, weights, slot_to_local, w13, w2, stats, nv), eager)
    assert counter.frame_count == 1
    explanation = torch._dynamo.explain(layer)(x, ids, weights, slot_to_local, w13, w2, stats, nv)
    assert explanation.graph_break_count == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(hidden=a["hidden"][0]), "hidden should be a 2d tensor"),
        (lambda a: a.update(hidden=a["hidden"].double()), "hidden should be float32 or bfloat16"),
        (lambda a: a.update(slots=a["slots"].float()), "slots should be int32 or int64"),
        (
            lambda a: a.update(topk_weights=a["topk_weights"][:, :1]),
            "topk_weights should have slots' shape",
        ),
        (lambda a: a.update(w13=a["w13"][:, :-1]), "w13 should stack gate and up rows"),
        (lambda a: a.update(w2=a["w2"][:, :-1]), "w2 should have shape"),
        (lambda a: a.update(w2=a["w2"].bfloat16()), "w2 should have hidden's dtype"),
        (
            lambda a: a.update(stats=torch.zeros(4, dtype=torch.int64)),
            "stats should be a 1d tensor [2]",
        ),
        (lambda a: a.update(stats=torch.zeros(2, dtype=torch.int32)), "stats should be int64"),
        (
            lambda a: a.update(num_valid_tokens=torch.tensor([1])),
            "num_valid_tokens should be a 0-d",
        ),
    ],
)
def test_fake_kernel_refuses_bad_inputs(change, message):
    *args, _ = make_layer(1, 8, 16, 8, 2, 2, 4, torch.float32)
    names = ("hidden", "slots", "topk_weights", "slot_to_local", "w13", "w2")
    inputs = dict(zip(names, args, strict=True))
    inputs.update(stats=torch.zeros(2, dtype=torch.int64), num_valid_tokens=torch.tensor(8))
    change(inputs)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with (
        FakeTensorMode(allow_non_fake_inputs=True),
        pytest.raises(RuntimeError, match=message.replace("[", r"\[")),
    ):
        ops.op_handles()["local_experts"](*inputs.values())
