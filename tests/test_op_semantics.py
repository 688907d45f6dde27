"""Semantics of ``torch.ops.eplb_graph.*``: native CPU kernel and ATen reference vs a Python oracle.

The oracle below is written from the op spec (loops over t and k, Python integers), not from the
library code. Every property is checked against both implementations:

- ``native``: ``torch.ops.eplb_graph.*`` on CPU tensors, which dispatches to the fused C++ kernel;
- ``reference``: ``eplb_graph.ops.reference.*_ref`` called directly (every device's ATen oracle).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from eplb_graph import EplbState, Placement, ops
from eplb_graph.ops import native
from eplb_graph.ops.reference import map_and_record_ref, map_to_physical_ref, record_load_ref

OPS = torch.ops.eplb_graph
INDEX_DTYPES = (torch.int32, torch.int64)
INVALID_IDS = (-1, -5)  # plus N and N + 3, which depend on N
HYPOTHESIS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", autouse=True)
def _native_kernel():
    """Build/load the native kernel once, so 'native' really is the C++ kernel where possible."""
    native.ensure_loaded()


def test_native_kernel_is_loaded():
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        pytest.skip("ninja missing: CPU calls run the reference kernel")
    assert native.status() is native.NativeStatus.LOADED, native.failure_reason()


# -- the oracle: plain Python, from the spec ----------------------------------------------------

GOLDEN = 2654435769


def oracle_hash(t: int, offset: int) -> int:
    return ((t + offset) * GOLDEN) % 2**32


def oracle_map(topk_ids, log2phy, replica_count, offset: int) -> list[list[int]]:
    """``topk_ids [T][K]``, ``log2phy [N][R]``, ``replica_count [N]`` as nested lists."""
    num_experts, width = len(log2phy), len(log2phy[0])
    out = []
    for t, row in enumerate(topk_ids):
        h = oracle_hash(t, offset)
        out_row = []
        for e in row:
            if not 0 <= e < num_experts:
                out_row.append(-1)
                continue
            replica = min(h % max(replica_count[e], 1), width - 1)
            slot = log2phy[e][replica]
            if slot == -1:  # torn refresh: count newer than the row
                slot = log2phy[e][0]
            out_row.append(slot)
        out.append(out_row)
    return out


def oracle_record(load, physical_ids, num_valid_tokens: int, record_enabled: bool) -> list[int]:
    load = list(load)
    for t, row in enumerate(physical_ids):
        if not (record_enabled and t < num_valid_tokens):
            continue
        for slot in row:
            if 0 <= slot < len(load):
                load[slot] += 1
    return load


# -- the two implementations under test ---------------------------------------------------------

IMPLS = {
    "native": (OPS.map_to_physical, OPS.record_load, OPS.map_and_record),
    "reference": (map_to_physical_ref, record_load_ref, map_and_record_ref),
}


def impl_params():
    return pytest.mark.parametrize("impl", list(IMPLS))


# -- strategies ---------------------------------------------------------------------------------

offsets = st.one_of(
    st.just(0),
    st.integers(-(2**40), 2**40),
    st.integers(2**32 - 70, 2**32 + 70),
    st.integers(2**62 - 70, 2**62 + 70),
    st.integers(-(2**62) - 70, -(2**62) + 70),
    st.integers(-100, -1),
)
index_dtypes = st.sampled_from(INDEX_DTYPES)


@st.composite
def tables(draw, num_slots: int | None = None):
    """``(log2phy [N][R], replica_count [N], P)``: valid slot ids, -1 padded, mixed counts.

    Most counts equal the populated width of the row; some are 0, torn (count > populated) or
    over-wide (count > R), which the op must clamp or fall back on.
    """
    num_experts = draw(st.integers(1, 9))
    width = draw(st.integers(1, 4))
    if num_slots is None:
        num_slots = draw(st.integers(1, 40))
    log2phy, counts = [], []
    for _ in range(num_experts):
        populated = draw(st.integers(1, width))
        slots = draw(
            st.lists(st.integers(0, num_slots - 1), min_size=populated, max_size=populated)
        )
        log2phy.append(slots + [-1] * (width - populated))
        counts.append(
            draw(st.one_of(st.just(populated), st.just(populated), st.integers(0, width + 2)))
        )
    return log2phy, counts, num_slots


def logical_ids(num_experts: int):
    return st.one_of(
        st.integers(0, num_experts - 1),
        st.sampled_from((*INVALID_IDS, num_experts, num_experts + 3)),
    )


@st.composite
def id_matrix(draw, elements, max_rows: int = 24):
    rows = draw(st.integers(0, max_rows))
    cols = draw(st.integers(1, 8))
    flat = draw(st.lists(elements, min_size=rows * cols, max_size=rows * cols))
    return [flat[t * cols : (t + 1) * cols] for t in range(rows)], cols


@st.composite
def map_cases(draw):
    log2phy, counts, num_slots = draw(tables())
    ids, cols = draw(id_matrix(logical_ids(len(log2phy))))
    rows = len(ids)
    return {
        "ids": ids,
        "cols": cols,
        "log2phy": log2phy,
        "counts": counts,
        "num_slots": num_slots,
        "offset": draw(offsets),
        "ids_dtype": draw(index_dtypes),
        "table_dtype": draw(index_dtypes),
        "count_dtype": draw(index_dtypes),
        "load_dtype": draw(index_dtypes),
        "valid": draw(st.integers(-1, rows + 2)),
        "valid_dtype": draw(st.sampled_from((torch.int64, torch.int32, torch.int16))),
        "record": draw(st.booleans()),
        "strided": draw(st.booleans()),
    }


def strided_copy(values: torch.Tensor, strided: bool) -> torch.Tensor:
    """``values`` itself, or an equal non-contiguous view (every other element of a bigger one)."""
    if not strided:
        return values.clone()
    if values.dim() == 1:
        big = torch.full((values.shape[0] * 2,), 12345, dtype=values.dtype)
        big[::2] = values
        view = big[::2]
    else:
        big = torch.full((values.shape[1] * 2, values.shape[0]), 12345, dtype=values.dtype)
        big[::2] = values.t()
        view = big[::2].t()
    assert torch.equal(view, values)
    return view


def build(case):
    cols = case["cols"]
    ids = torch.tensor(case["ids"], dtype=case["ids_dtype"]).reshape(-1, cols)
    strided = case["strided"]
    return {
        "topk_ids": strided_copy(ids, strided),
        "log2phy": strided_copy(torch.tensor(case["log2phy"], dtype=case["table_dtype"]), strided),
        "replica_count": strided_copy(
            torch.tensor(case["counts"], dtype=case["count_dtype"]), strided
        ),
        "offset": torch.tensor(case["offset"], dtype=torch.int64),
        "load": strided_copy(
            torch.randint(0, 5, (case["num_slots"],), dtype=case["load_dtype"]), strided
        ),
        "num_valid_tokens": torch.tensor(case["valid"], dtype=case["valid_dtype"]),
        "record_enabled": torch.tensor(case["record"]),
    }


def expected_map(case):
    return oracle_map(case["ids"], case["log2phy"], case["counts"], case["offset"])


# -- map_to_physical ----------------------------------------------------------------------------


@given(case=map_cases())
@HYPOTHESIS
def test_map_to_physical_matches_oracle(case):
    expected = expected_map(case)
    for impl, (map_fn, _, _) in IMPLS.items():
        args = build(case)
        inputs = {k: args[k].clone() for k in ("topk_ids", "log2phy", "replica_count", "offset")}
        out = map_fn(args["topk_ids"], args["log2phy"], args["replica_count"], args["offset"])
        assert out.dtype == case["ids_dtype"], impl
        assert out.shape == (len(case["ids"]), case["cols"]), impl
        assert out.tolist() == expected, impl
        for name, before in inputs.items():  # a pure op: inputs untouched
            assert torch.equal(args[name], before), (impl, name)


@impl_params()
@pytest.mark.parametrize("ids_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("shape", [(0, 1), (0, 8), (1, 1), (5, 2), (16, 8)])
def test_output_dtype_and_shape(impl, ids_dtype, shape):
    map_fn, _, fused = IMPLS[impl]
    log2phy = torch.tensor([[0, 2], [1, -1], [3, -1]], dtype=torch.int64)
    count = torch.tensor([2, 1, 1], dtype=torch.int32)
    ids = torch.randint(-1, 4, shape, dtype=ids_dtype)
    offset = torch.tensor(7)
    out = map_fn(ids, log2phy, count, offset)
    assert (out.dtype, tuple(out.shape), out.device) == (ids_dtype, shape, ids.device)
    assert out.is_contiguous()
    load = torch.zeros(4, dtype=torch.int32)
    fused_out = fused(ids, log2phy, count, offset, load, torch.tensor(shape[0]), torch.tensor(True))
    assert (fused_out.dtype, tuple(fused_out.shape)) == (ids_dtype, shape)
    assert torch.equal(fused_out, out)
    assert int(load.sum()) == int(((ids >= 0) & (ids < 3)).sum())


@impl_params()
@given(offset=offsets, count=st.integers(2, 6), width=st.integers(2, 4))
@settings(max_examples=40, deadline=None)
def test_torn_refresh_falls_back_to_replica_zero(impl, offset, count, width):
    """A row whose entries beyond column 0 are -1 while the count says more: never -1."""
    map_fn, _, fused = IMPLS[impl]
    log2phy = torch.full((3, width), -1, dtype=torch.int64)
    log2phy[0, 0], log2phy[1, 0], log2phy[2, :2] = 5, 2, torch.tensor([0, 4])
    replica_count = torch.tensor([count, 3, 3])  # expert 0, 1 torn; expert 2 torn at column 2
    ids = torch.tensor([[0, 1, 2]] * 64)
    out = map_fn(ids, log2phy, replica_count, torch.tensor(offset))
    assert (out[:, 0] == 5).all()
    assert (out[:, 1] == 2).all()
    assert set(out[:, 2].tolist()) <= {0, 4}
    assert out.tolist() == oracle_map(ids.tolist(), log2phy.tolist(), [count, 3, 3], offset)
    load = torch.zeros(6, dtype=torch.int64)
    out2 = fused(
        ids,
        log2phy,
        replica_count,
        torch.tensor(offset),
        load,
        torch.tensor(64),
        torch.tensor(True),
    )
    assert torch.equal(out2, out)
    assert int(load[5]) == 64 and int(load[2]) == 64


def test_all_k_choices_of_a_row_share_the_hash():
    """Columns naming the same expert in one row always pick the same replica."""
    log2phy = torch.tensor([[0, 1, 2, 3]])
    ids = torch.zeros(256, 8, dtype=torch.int64)
    for impl, (map_fn, _, _) in IMPLS.items():
        out = map_fn(ids, log2phy, torch.tensor([4]), torch.tensor(11))
        assert (out == out[:, :1]).all(), impl
        assert set(out[:, 0].tolist()) == {0, 1, 2, 3}, impl


# -- record_load --------------------------------------------------------------------------------


@st.composite
def record_cases(draw):
    num_slots = draw(st.integers(1, 30))
    elements = st.one_of(
        st.integers(0, num_slots - 1),
        st.sampled_from((-1, -5, num_slots, num_slots + 3, 2**31 - 1, -(2**31))),
    )
    ids, cols = draw(id_matrix(elements))
    return {
        "ids": ids,
        "cols": cols,
        "num_slots": num_slots,
        "ids_dtype": draw(index_dtypes),
        "load_dtype": draw(index_dtypes),
        "valid": draw(st.integers(-1, len(ids) + 2)),
        "valid_dtype": draw(st.sampled_from((torch.int64, torch.int32, torch.int16))),
        "record": draw(st.booleans()),
        "strided": draw(st.booleans()),
        "start": draw(st.lists(st.integers(0, 9), min_size=num_slots, max_size=num_slots)),
    }


@given(case=record_cases())
@HYPOTHESIS
def test_record_load_matches_oracle(case):
    """record_load alone: ids outside [0, P) (including -1 and huge ones) never count."""
    expected = oracle_record(case["start"], case["ids"], case["valid"], case["record"])
    for impl, (_, record_fn, _) in IMPLS.items():
        ids = torch.tensor(case["ids"], dtype=case["ids_dtype"]).reshape(-1, case["cols"])
        ids = strided_copy(ids, case["strided"])
        load = strided_copy(torch.tensor(case["start"], dtype=case["load_dtype"]), case["strided"])
        ptr = load.data_ptr()
        result = record_fn(
            load,
            ids,
            torch.tensor(case["valid"], dtype=case["valid_dtype"]),
            torch.tensor(case["record"]),
        )
        assert result is None, impl
        assert load.data_ptr() == ptr and load.dtype == case["load_dtype"], impl
        assert load.tolist() == expected, impl


# -- map_and_record -----------------------------------------------------------------------------


@given(case=map_cases())
@HYPOTHESIS
def test_map_and_record_matches_oracle(case):
    expected_out = expected_map(case)
    for impl, (map_fn, record_fn, fused) in IMPLS.items():
        args = build(case)
        start = args["load"].tolist()
        expected_load = oracle_record(start, expected_out, case["valid"], case["record"])
        out = fused(*args.values())
        assert out.dtype == case["ids_dtype"], impl
        assert out.tolist() == expected_out, impl
        assert args["load"].tolist() == expected_load, impl
        # Fused == unfused composition of the same implementation.
        load = torch.tensor(start, dtype=case["load_dtype"])
        mapped = map_fn(args["topk_ids"], args["log2phy"], args["replica_count"], args["offset"])
        record_fn(load, mapped, args["num_valid_tokens"], args["record_enabled"])
        assert torch.equal(mapped, out) and torch.equal(load, args["load"]), impl


@impl_params()
def test_invariant4_padding_and_invalid_ids_not_counted(impl):
    """Rows at/after num_valid_tokens, invalid logical ids and a disabled record never count."""
    _, record_fn, fused = IMPLS[impl]
    log2phy = torch.tensor([[0, 3], [1, -1], [2, -1]])
    count = torch.tensor([2, 1, 1])
    ids = torch.tensor([[0, 1], [2, -1], [3, -5], [1, 7], [0, 0], [2, 2]])  # rows 4, 5: padding
    for valid, record in [(4, True), (0, True), (6, False), (4, False), (-3, True)]:
        load = torch.zeros(4, dtype=torch.int64)
        out = fused(
            ids, log2phy, count, torch.tensor(0), load, torch.tensor(valid), torch.tensor(record)
        )
        # Ids 3, 7 (>= N=3) and -1, -5 map to -1; the rest to their only/hashed slot.
        assert out[1].tolist() == [2, -1] and out[2].tolist() == [-1, -1]
        assert out[3].tolist() == [1, -1]
        counted = [(t, s) for t, row in enumerate(out.tolist()) for s in row]
        counted = [s for t, s in counted if record and t < valid and s >= 0]
        assert load.tolist() == [counted.count(p) for p in range(4)]
        if not record or valid <= 0:
            assert load.sum() == 0
    # record_load alone: ids outside [0, P) including P itself.
    load = torch.zeros(3, dtype=torch.int32)
    record_fn(load, torch.tensor([[0, 3], [-1, 2], [2, 1]]), torch.tensor(2), torch.tensor(True))
    assert load.tolist() == [1, 0, 1]


def test_native_and_reference_agree_on_the_parallel_path():
    """T*K >= 16384 runs the native kernel multi-threaded with atomic adds."""
    previous = torch.get_num_threads()
    torch.set_num_threads(max(previous, 2))
    try:
        gen = torch.Generator().manual_seed(0)
        num_experts, width, rows, cols = 32, 3, 8192, 4
        log2phy = torch.randint(0, 64, (num_experts, width), generator=gen)
        counts = torch.randint(0, width + 2, (num_experts,), generator=gen)
        log2phy[counts == 1, 1:] = -1
        ids = torch.randint(-2, num_experts + 2, (rows, cols), generator=gen, dtype=torch.int32)
        offset = torch.tensor(2**32 - 1000)
        expected = oracle_map(ids.tolist(), log2phy.tolist(), counts.tolist(), int(offset))
        expected_load = oracle_record([0] * 64, expected, rows - 5, True)
        for impl, (_, _, fused) in IMPLS.items():
            load = torch.zeros(64, dtype=torch.int32)
            out = fused(
                ids, log2phy, counts, offset, load, torch.tensor(rows - 5), torch.tensor(True)
            )
            assert out.tolist() == expected, impl
            assert load.tolist() == expected_load, impl
    finally:
        torch.set_num_threads(previous)


# -- replica spread -----------------------------------------------------------------------------

NUM_EXPERTS, HOT = 16, 5


def hot_state(replicas: int, rank: int = 0, num_ranks: int = 1, dtype=torch.int64) -> EplbState:
    """Experts 0..15 in slots 0..15, plus ``replicas - 1`` redundant slots of the hot expert."""
    row = list(range(NUM_EXPERTS)) + [HOT] * (replicas - 1)
    placement = Placement([row], NUM_EXPERTS, num_ranks)
    return EplbState(placement, max_replicas=4, index_dtype=dtype, load_dtype=dtype, rank=rank)


def hot_ids(rows: int, cols: int, start_row: int = 0) -> torch.Tensor:
    """The hot expert in column ``t % cols`` of row t, distinct cold experts elsewhere."""
    gen = torch.Generator().manual_seed(cols)
    cold = [e for e in range(NUM_EXPERTS) if e != HOT]
    ids = torch.empty(rows, cols, dtype=torch.int64)
    for t in range(rows):
        picks = torch.randperm(len(cold), generator=gen)[:cols].tolist()
        ids[t] = torch.tensor([cold[i] for i in picks])
        ids[t, (start_row + t) % cols] = HOT
    return ids


def assert_uniform(counts: list[int], total: int) -> None:
    assert sum(counts) == total
    mean = total / len(counts)
    assert all(abs(c - mean) <= 0.1 * mean for c in counts), counts


@impl_params()
@pytest.mark.parametrize("cols", [1, 2, 8])
@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_hot_expert_spreads_over_replicas_big_batch(impl, replicas, cols):
    _, _, fused = IMPLS[impl]
    rows = 4096
    state = hot_state(replicas)
    state.set_step_inputs_(rows, record=True)
    tables = state.layer(0)
    out = fused(
        hot_ids(rows, cols),
        tables.log2phy,
        tables.replica_count,
        state.offset,
        tables.load,
        state.num_valid_tokens,
        state.record_enabled,
    )
    hot_slots = tables.log2phy[HOT, :replicas].tolist()
    assert hot_slots == [HOT, *range(NUM_EXPERTS, NUM_EXPERTS + replicas - 1)]
    assert_uniform([int(tables.load[s]) for s in hot_slots], rows)
    assert_uniform([int((out == s).sum()) for s in hot_slots], rows)


@impl_params()
@pytest.mark.parametrize("cols", [1, 2, 8])
@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_hot_expert_spreads_over_replicas_across_decode_steps(impl, replicas, cols):
    """T=1 per step; the offset advances by one per step, as a decode loop does."""
    _, _, fused = IMPLS[impl]
    steps = 1200
    state = hot_state(replicas, dtype=torch.int32)
    state.set_step_inputs_(1, record=True)
    tables = state.layer(0)
    ids = hot_ids(steps, cols).to(torch.int32)
    for step in range(steps):
        fused(
            ids[step : step + 1],
            tables.log2phy,
            tables.replica_count,
            state.offset,
            tables.load,
            state.num_valid_tokens,
            state.record_enabled,
        )
        state.advance_offset_()
    assert int(state.offset) == steps
    hot_slots = tables.log2phy[HOT, :replicas].tolist()
    assert_uniform([int(tables.load[s]) for s in hot_slots], steps)


@impl_params()
def test_rank_seeded_offsets_pick_different_replicas(impl):
    """offset = rank: with two replicas, ranks 0 and 1 pick different ones at every step/row."""
    map_fn, _, _ = IMPLS[impl]
    row = [0, 1, 2, 3, 0, 1]  # expert 0 in slots 0 and 4, expert 1 in slots 1 and 5
    states = [EplbState(Placement([row], 4, 2), rank=rank) for rank in (0, 1)]
    assert [int(s.offset) for s in states] == [0, 1]
    ids = torch.tensor([[0, 1]] * 8)
    seen = [set(), set()]
    for _ in range(50):
        outs = []
        for rank, state in enumerate(states):
            tables = state.layer(0)
            out = map_fn(ids, tables.log2phy, tables.replica_count, state.offset)
            outs.append(out)
            seen[rank].update(out[:, 0].tolist())
            state.advance_offset_()
        assert (outs[0] != outs[1]).all()
        assert ((outs[0][:, 0] == 0) == (outs[0][:, 1] == 1)).all()  # one hash per row
    assert seen == [{0, 4}, {0, 4}]


# -- error handling -----------------------------------------------------------------------------


def good_args():
    return {
        "topk_ids": torch.tensor([[0, 1], [2, 0]]),
        "log2phy": torch.tensor([[0, 3], [1, -1], [2, -1]]),
        "replica_count": torch.tensor([2, 1, 1]),
        "offset": torch.tensor(0),
        "load": torch.zeros(4, dtype=torch.int64),
        "num_valid_tokens": torch.tensor(2),
        "record_enabled": torch.tensor(True),
    }


MAP_ARGS = ("topk_ids", "log2phy", "replica_count", "offset")
RECORD_ARGS = ("load", "physical_ids", "num_valid_tokens", "record_enabled")
FUSED_ARGS = (*MAP_ARGS, "load", "num_valid_tokens", "record_enabled")
OP_ARGS = {"map_to_physical": MAP_ARGS, "record_load": RECORD_ARGS, "map_and_record": FUSED_ARGS}

# (argument, how to break it, message), by kind. "physical_ids" exists for record_load only.
BAD_INPUTS = [
    ("topk_ids", lambda t: t.reshape(-1), "topk_ids should be a 2d tensor"),
    ("topk_ids", lambda t: t[None], "topk_ids should be a 2d tensor"),
    ("topk_ids", lambda t: t.float(), "topk_ids should be int32 or int64"),
    ("topk_ids", lambda t: t.to(torch.int16), "topk_ids should be int32 or int64"),
    ("log2phy", lambda t: t.reshape(-1), "log2phy should be a 2d tensor"),
    ("log2phy", lambda t: t.double(), "log2phy should be int32 or int64"),
    ("log2phy", lambda t: t[:, :0], "log2phy should have at least one expert and one replica"),
    ("replica_count", lambda t: t[None], "replica_count should be a 1d tensor"),
    ("replica_count", lambda t: t.to(torch.uint8), "replica_count should be int32 or int64"),
    ("replica_count", lambda t: t[:2], "replica_count has 2 experts but log2phy has 3"),
    ("offset", lambda t: t.reshape(1), "offset should be a 0-d tensor"),
    ("offset", lambda t: t.int(), "offset should be int64"),
    ("load", lambda t: t.reshape(2, 2), "load should be a 1d tensor"),
    ("load", lambda t: t.float(), "load should be int32 or int64"),
    ("physical_ids", lambda t: t.reshape(-1), "physical_ids should be a 2d tensor"),
    ("physical_ids", lambda t: t.float(), "physical_ids should be int32 or int64"),
    ("num_valid_tokens", lambda t: t.reshape(1), "num_valid_tokens should be a 0-d tensor"),
    ("num_valid_tokens", lambda t: t.float(), "num_valid_tokens should be an integer tensor"),
    ("num_valid_tokens", lambda t: t.bool(), "num_valid_tokens should be an integer tensor"),
    ("record_enabled", lambda t: t.reshape(1), "record_enabled should be a 0-d tensor"),
    ("record_enabled", lambda t: t.long(), "record_enabled should be a bool tensor"),
]

ERROR_CASES = [
    pytest.param(op, arg, breaker, message, id=f"{op}-{arg}-{i}")
    for op, names in OP_ARGS.items()
    for i, (arg, breaker, message) in enumerate(BAD_INPUTS)
    if arg in names
]


def op_inputs(op: str, broken: str, breaker) -> list[torch.Tensor]:
    args = good_args()
    args["physical_ids"] = args["topk_ids"]
    args[broken] = breaker(args[broken])
    return [args[name] for name in OP_ARGS[op]]


REFERENCE = {
    "map_to_physical": map_to_physical_ref,
    "record_load": record_load_ref,
    "map_and_record": map_and_record_ref,
}


@pytest.mark.parametrize("kernel", ["native", "reference", "fake"])
@pytest.mark.parametrize(("op", "arg", "breaker", "message"), ERROR_CASES)
def test_bad_input_raises_naming_the_argument(kernel, op, arg, breaker, message):
    inputs = op_inputs(op, arg, breaker)
    if kernel == "native":
        call = lambda: getattr(OPS, op)(*inputs)  # noqa: E731
    elif kernel == "reference":
        call = lambda: REFERENCE[op](*inputs)  # noqa: E731
    else:
        mode = FakeTensorMode()
        fakes = [mode.from_tensor(t) for t in inputs]

        def call():
            with mode:
                getattr(OPS, op)(*fakes)

    with pytest.raises(RuntimeError, match=message):
        call()


DEVICE_CASES = [
    pytest.param(op, arg, id=f"{op}-{arg}")
    for op, names in OP_ARGS.items()
    for arg in names
    if arg != names[0]
]


@pytest.mark.parametrize("kernel", ["reference", "fake"])
@pytest.mark.parametrize(("op", "arg"), DEVICE_CASES)
def test_tensors_on_two_devices_raise_naming_the_argument(kernel, op, arg):
    inputs = op_inputs(op, arg, lambda t: t.to("meta"))
    message = f"{op}: all tensors must be on one device.*\\b{arg} (is )?on meta"
    with pytest.raises(RuntimeError, match=message):
        if kernel == "reference":
            REFERENCE[op](*inputs)
        else:
            mode = FakeTensorMode()
            fakes = [mode.from_tensor(t) for t in inputs]
            with mode:
                getattr(OPS, op)(*fakes)


@pytest.mark.parametrize(("op", "arg"), [*DEVICE_CASES, ("map_to_physical", "topk_ids")])
def test_native_kernel_rejects_non_cpu_tensors_naming_the_argument(op, arg):
    if native.status() is not native.NativeStatus.LOADED:
        pytest.skip("native kernel not loaded")
    inputs = op_inputs(op, arg, lambda t: t.to("meta"))
    # A plain call with a meta tensor dispatches to the fake kernel; call the CPU kernel itself.
    kernel = getattr(OPS, op).default
    with pytest.raises(RuntimeError, match=f"{arg} must be a CPU tensor"):
        kernel._op_dk(torch._C.DispatchKey.CPU, *inputs)


@pytest.mark.parametrize(
    ("op", "arg", "breaker"),
    [
        ("record_load", "load", lambda t: t.float()),
        ("record_load", "physical_ids", lambda t: t.float()),
        ("map_and_record", "load", lambda t: t.float()),
    ],
)
def test_native_checks_dtypes_even_when_record_is_disabled(op, arg, breaker):
    inputs = op_inputs(op, arg, breaker)
    inputs[-1] = torch.tensor(False)
    with pytest.raises(RuntimeError, match=f"{arg} should be int32 or int64"):
        REFERENCE[op](*inputs)  # reference (and fake) reject
    with pytest.raises(RuntimeError, match=f"{arg} should be int32 or int64"):
        getattr(OPS, op)(*inputs)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_native_and_reference_agree_on_num_valid_tokens_dtype(dtype):
    inputs = op_inputs("record_load", "num_valid_tokens", lambda t: t.to(dtype))
    with pytest.raises(RuntimeError, match="num_valid_tokens should be an integer tensor"):
        record_load_ref(*inputs)
    with pytest.raises(RuntimeError, match="num_valid_tokens should be an integer tensor"):
        OPS.record_load(*inputs)


# -- invariant 9: no host sync in the reference kernels -------------------------------------------

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense.default, aten.item.default, aten.nonzero.default}


class HostSyncDetector(TorchDispatchMode):
    """Raises on any aten op that reads device data on the host or has a data-dependent shape."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tags = getattr(func, "tags", ())
        if (
            func in SYNC_OPS
            or func.overloadpacket in (aten.item, aten._local_scalar_dense, aten.nonzero)
            or torch.Tag.data_dependent_output in tags
            or torch.Tag.dynamic_output_shape in tags
        ):
            raise AssertionError(f"host sync / data-dependent op in a reference kernel: {func}")
        self.seen.add(func.overloadpacket)
        return func(*args, **(kwargs or {}))


def test_host_sync_detector_catches_syncs():
    x = torch.arange(4)
    syncs = (lambda: x.sum().item(), lambda: bool(x.sum()), lambda: x.nonzero(), lambda: x[x > 1])
    for sync in syncs:
        with pytest.raises(AssertionError, match="host sync"), HostSyncDetector():
            sync()


@given(case=map_cases())
@settings(max_examples=25, deadline=None)
def test_invariant9_no_host_sync_in_reference_kernels(case):
    args = build(case)
    with HostSyncDetector() as detector:
        mapped = map_to_physical_ref(*(args[k] for k in MAP_ARGS))
        record_load_ref(
            args["load"].clone(), mapped, args["num_valid_tokens"], args["record_enabled"]
        )
        map_and_record_ref(*args.values())
    assert {aten.index_select, aten.scatter_add_, aten.remainder} <= detector.seen
    assert mapped.tolist() == expected_map(case)


def test_op_handles_cover_every_op():
    assert set(ops.op_handles()) == {
        "map_to_physical",
        "record_load",
        "map_and_record",
        "local_experts",
        "local_experts_w8a8",
    }


def test_oracle_hash_matches_known_values():
    """Pin the oracle itself: Knuth's constant, mod 2**32, negative offsets wrap."""
    assert oracle_hash(0, 0) == 0
    assert oracle_hash(1, 0) == GOLDEN
    assert oracle_hash(0, 2) == (2 * GOLDEN) % 2**32
    assert oracle_hash(0, -1) == oracle_hash(0, 2**32 - 1)
    assert oracle_hash(5, 2**62) == oracle_hash(5, 0)  # 2**62 is 0 mod 2**32
    rng = random.Random(0)
    for _ in range(20):
        t, off = rng.randrange(1000), rng.randrange(-(2**62), 2**62)
        row = torch.tensor(oracle_hash(t, off))
        assert int(ops.replica_hash(t + 1, torch.tensor(off))[t]) == int(row)
