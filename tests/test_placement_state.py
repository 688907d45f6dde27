"""``Placement`` (host value object) and ``EplbState`` (stable-address device tensors).

Derived tables are checked against a plain-Python oracle; every validation error is pinned by its
message; commits are checked to write in place (addresses never change) and to write nothing at
all when rejected.
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_graph import EplbState, Placement, PlacementError
from eplb_graph.state import EplbStateError, PreparedLayer
from eplb_graph.tables import check_slots_per_rank

OPS = torch.ops.eplb_graph
INDEX_DTYPES = (torch.int32, torch.int64)


# -- oracle -------------------------------------------------------------------------------------


def oracle_log2phy(phy2log: list[list[int]], num_logical: int, width: int) -> list:
    """``[L][N][R]``: slots of each expert in ascending slot order, padded with -1."""
    result = []
    for row in phy2log:
        slots = [[p for p, expert in enumerate(row) if expert == e] for e in range(num_logical)]
        result.append([s + [-1] * (width - len(s)) for s in slots])
    return result


def oracle_counts(phy2log: list[list[int]], num_logical: int) -> list[list[int]]:
    return [[row.count(e) for e in range(num_logical)] for row in phy2log]


@st.composite
def placements(draw, max_layers: int = 3):
    """Random valid placements: every expert at least once, extra slots random, shuffled."""
    num_logical = draw(st.integers(1, 6))
    num_ranks = draw(st.integers(1, 4))
    per_rank_min = -(-num_logical // num_ranks)
    slots_per_rank = draw(st.integers(per_rank_min, per_rank_min + 3))
    num_slots = num_ranks * slots_per_rank
    rows = []
    for _ in range(draw(st.integers(1, max_layers))):
        extra = draw(
            st.lists(
                st.integers(0, num_logical - 1),
                min_size=num_slots - num_logical,
                max_size=num_slots - num_logical,
            )
        )
        rows.append(draw(st.permutations(list(range(num_logical)) + extra)))
    return rows, num_logical, num_ranks


def random_row(rng: random.Random, num_logical: int, num_slots: int, max_count: int) -> list[int]:
    """A valid row where no expert exceeds ``max_count`` replicas."""
    while True:
        row = list(range(num_logical)) + [
            rng.randrange(num_logical) for _ in range(num_slots - num_logical)
        ]
        rng.shuffle(row)
        if max(row.count(e) for e in range(num_logical)) <= max_count:
            return row


# -- Placement ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "logical", "redundant", "ranks"), [(1, 4, 0, 1), (2, 4, 4, 4), (3, 3, 5, 2)]
)
def test_default_layout(layers, logical, redundant, ranks):
    placement = Placement.default(layers, logical, redundant, ranks)
    expected_row = list(range(logical)) + [j % logical for j in range(redundant)]
    assert placement.phy2log.tolist() == [expected_row] * layers
    assert placement.phy2log.dtype == torch.int64
    assert (placement.num_layers, placement.num_logical, placement.num_slots) == (
        layers,
        logical,
        logical + redundant,
    )
    assert placement.num_redundant == redundant and placement.num_ranks == ranks
    assert placement.slots_per_rank == (logical + redundant) // ranks
    counts = placement.replica_count()
    assert counts.tolist() == oracle_counts([expected_row] * layers, logical)
    # Layers of the default placement are independent storage, not views of one row.
    assert placement.phy2log.stride() == (logical + redundant, 1)


@given(case=placements(), extra_width=st.integers(0, 2))
@settings(max_examples=60, deadline=None)
def test_log2phy_replica_count_and_rank_of_slot_match_oracle(case, extra_width):
    rows, num_logical, num_ranks = case
    placement = Placement(torch.tensor(rows), num_logical, num_ranks)
    counts = oracle_counts(rows, num_logical)
    width = max(max(c) for c in counts) + extra_width
    log2phy = placement.log2phy(width)
    assert log2phy.dtype == torch.int64 and log2phy.shape == (len(rows), num_logical, width)
    assert log2phy.tolist() == oracle_log2phy(rows, num_logical, width)
    assert placement.replica_count().tolist() == counts
    assert placement.max_replica_count() == max(max(c) for c in counts)
    num_slots = len(rows[0])
    assert placement.rank_of_slot().tolist() == [
        p // (num_slots // num_ranks) for p in range(num_slots)
    ]
    for layer, row in enumerate(rows):
        assert placement.layer(layer).tolist() == row


def test_placement_is_a_value():
    rows = [[0, 1, 2, 0], [2, 1, 0, 1]]
    a = Placement(rows, 3, 2)
    b = Placement(torch.tensor(rows, dtype=torch.int32), 3, 2)
    assert a == b and hash(a) == hash(b)
    assert a != Placement(rows, 3, 1) and a != Placement([rows[0], rows[0]], 3, 2)
    c = a.with_layer(1, [0, 1, 2, 2])
    assert c.phy2log.tolist() == [rows[0], [0, 1, 2, 2]] and a.phy2log.tolist() == rows
    layer = a.layer(0)
    layer[0] = 2
    assert a.phy2log[0, 0] == 0  # layer() returns a copy


# -- validation errors, each with its message -------------------------------------------------

PLACEMENT_ERRORS = [
    pytest.param(
        torch.arange(4),
        4,
        1,
        r"phy2log must be 2-D \[num_layers, num_slots\], got shape \(4,\)",
        id="1d",
    ),
    pytest.param(
        torch.zeros(1, 2, 4, dtype=torch.int64),
        4,
        1,
        r"phy2log must be 2-D \[num_layers, num_slots\], got shape \(1, 2, 4\)",
        id="3d",
    ),
    pytest.param(
        torch.zeros(1, 4),
        4,
        1,
        "phy2log must hold integer expert ids, got dtype torch.float32",
        id="float",
    ),
    pytest.param(
        torch.tensor([[0, 1, 2, 3]], dtype=torch.float64),
        4,
        1,
        "got dtype torch.float64",
        id="double",
    ),
    pytest.param(torch.tensor([[0, 1, 2, 3]]).bool(), 4, 1, "got dtype torch.bool", id="bool"),
    pytest.param(
        [[0, 1, 2, 3], [0, 1, -1, 3]],
        4,
        1,
        re.escape("layer 1, slot 2: expert id -1 is out of range [0, 4)"),
        id="negative-id",
    ),
    pytest.param(
        [[0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 4, 0]],
        4,
        2,
        re.escape("layer 1, slot 4: expert id 4 is out of range [0, 4)"),
        id="id-equal-N",
    ),
    pytest.param(
        [[0, 1, 2, 3, 0, 99]],
        4,
        1,
        re.escape("layer 0, slot 5: expert id 99 is out of range [0, 4)"),
        id="id-above-N",
    ),
    pytest.param(
        [[0, 1, 2, 3], [0, 1, 1, 3]],
        4,
        1,
        "layer 1: logical expert 2 has no slot",
        id="expert-without-slot",
    ),
    pytest.param(
        [[0, 1, 2, 3, 0]],
        4,
        2,
        "num_slots P=5 is not divisible by num_ranks=2",
        id="P-not-divisible-by-ranks",
    ),
    pytest.param(
        [[0, 1, 2]],
        4,
        1,
        "num_slots P=3 is smaller than num_logical N=4",
        id="fewer-slots-than-experts",
    ),
    pytest.param([[0, 1], [2]], 4, 1, "phy2log is not a rectangular integer array", id="ragged"),
    pytest.param([[0]], 0, 1, "num_logical must be >= 1, got 0", id="no-experts"),
    pytest.param([[0]], 1, 0, "num_ranks must be >= 1, got 0", id="no-ranks"),
]


@pytest.mark.parametrize(("phy2log", "num_logical", "num_ranks", "message"), PLACEMENT_ERRORS)
def test_placement_validation_errors(phy2log, num_logical, num_ranks, message):
    with pytest.raises(PlacementError, match=message):
        Placement(phy2log, num_logical, num_ranks)


def test_check_slots_per_rank_is_the_one_divisibility_check():
    assert check_slots_per_rank(12, 4) == 3
    with pytest.raises(PlacementError, match="num_replicas P=10 is not divisible by num_ranks=4"):
        check_slots_per_rank(10, 4, name="num_replicas")
    with pytest.raises(PlacementError, match="num_ranks must be >= 1, got 0"):
        check_slots_per_rank(10, 0)

    class OwnError(ValueError):
        pass

    with pytest.raises(OwnError, match="cannot be split evenly"):
        check_slots_per_rank(10, 3, error=OwnError)


def test_placement_error_is_a_value_error():
    assert issubclass(PlacementError, ValueError)


def test_default_rejects_bad_sizes():
    with pytest.raises(PlacementError, match="num_layers must be >= 1, got 0"):
        Placement.default(0, 4, 0, 1)
    with pytest.raises(PlacementError, match="num_redundant must be >= 0, got -1"):
        Placement.default(1, 4, -1, 1)
    with pytest.raises(PlacementError, match="num_slots P=5 is not divisible by num_ranks=2"):
        Placement.default(1, 4, 1, 2)


def test_log2phy_too_narrow_names_layer_and_expert():
    placement = Placement([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 3, 3]], 4, 2)
    message = re.escape(
        "layer 1: expert 3 has 3 replicas but the lookup width R=2 "
        "(max_replicas chosen at start-up) holds at most 2"
    )
    with pytest.raises(PlacementError, match=message):
        placement.log2phy(2)
    with pytest.raises(PlacementError, match="max_replicas must be >= 1, got 0"):
        placement.log2phy(0)


def test_too_many_replicas_for_max_replicas_in_state():
    placement = Placement([[0, 1, 2, 3, 0, 0]], 4, 2)
    with pytest.raises(PlacementError, match=r"layer 0: expert 0 has 3 replicas .* R=2"):
        EplbState(placement, max_replicas=2)
    assert EplbState(placement).max_replicas == 3  # default: num_redundant + 1


# -- EplbState ----------------------------------------------------------------------------------


def assert_state_matches(state: EplbState, rows: list[list[int]]) -> None:
    num_logical, width = state.num_logical, state.max_replicas
    assert state.phy2log.tolist() == rows
    assert state.log2phy.tolist() == oracle_log2phy(rows, num_logical, width)
    assert state.replica_count.tolist() == oracle_counts(rows, num_logical)
    assert state.placement.phy2log.tolist() == rows


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("load_dtype", INDEX_DTYPES)
def test_state_allocation(index_dtype, load_dtype):
    placement = Placement.default(3, 4, 4, 4)
    state = EplbState(placement, index_dtype=index_dtype, load_dtype=load_dtype, rank=3)
    tensors = state.graph_tensors()
    assert set(tensors) == {
        "log2phy",
        "replica_count",
        "phy2log",
        "load",
        "record_enabled",
        "num_valid_tokens",
        "offset",
    }
    assert state.log2phy.shape == (3, 4, 5) and state.log2phy.dtype == index_dtype
    assert state.replica_count.dtype == index_dtype and state.phy2log.dtype == index_dtype
    assert state.load.shape == (3, 8) and state.load.dtype == load_dtype
    assert not state.load.any()
    assert state.offset.dtype == torch.int64 and int(state.offset) == 3  # offset seeded by rank
    assert state.num_valid_tokens.dtype == torch.int64 and bool(state.record_enabled)
    assert all(t.is_contiguous() for t in tensors.values())
    assert_state_matches(state, placement.phy2log.tolist())
    tables = state.layer(2)
    assert tables.log2phy.data_ptr() == state.log2phy[2].data_ptr()
    assert tables.load.data_ptr() == state.load[2].data_ptr()


def test_state_rejects_bad_construction_arguments():
    placement = Placement.default(1, 4, 0, 2)
    with pytest.raises(TypeError, match=r"index_dtype must be torch\.int32 or torch\.int64"):
        EplbState(placement, index_dtype=torch.int16)
    with pytest.raises(TypeError, match=r"load_dtype must be torch\.int32 or torch\.int64"):
        EplbState(placement, load_dtype=torch.float32)
    with pytest.raises(ValueError, match=re.escape("rank must be in [0, 2), got 2")):
        EplbState(placement, rank=2)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_commits_write_in_place_and_never_move_a_tensor(index_dtype):
    """Many random commits (one layer or all layers): rows change, addresses never do."""
    rng = random.Random(index_dtype.itemsize)
    num_layers, num_logical, num_ranks, num_slots, width = 3, 5, 2, 8, 3
    placement = Placement(
        [random_row(rng, num_logical, num_slots, width)] * num_layers, num_logical, num_ranks
    )
    state = EplbState(placement, max_replicas=width, index_dtype=index_dtype)
    ptrs = state.data_ptrs()
    objects = {name: id(t) for name, t in state.graph_tensors().items()}
    rows = placement.phy2log.tolist()
    for step in range(60):
        if step % 7 == 6:
            rows = [random_row(rng, num_logical, num_slots, width) for _ in range(num_layers)]
            state.commit_(Placement(rows, num_logical, num_ranks))
        else:
            layer = rng.randrange(num_layers)
            row = random_row(rng, num_logical, num_slots, width)
            as_tensor = rng.random() < 0.5
            state.commit_layer_(layer, torch.tensor(row) if as_tensor else row)
            rows[layer] = row
        assert_state_matches(state, rows)
        assert state.data_ptrs() == ptrs
        assert {name: id(t) for name, t in state.graph_tensors().items()} == objects
        assert state.log2phy.dtype == index_dtype


@given(case=placements(max_layers=2), data=st.data())
@settings(max_examples=40, deadline=None)
def test_invariant3_lookup_changes_only_on_commit(case, data):
    """Step controls never touch the lookup; a commit changes it in place, seen through views
    taken before the commit (what a captured graph holds), and only then."""
    rows, num_logical, num_ranks = case
    state = EplbState(Placement(rows, num_logical, num_ranks), index_dtype=torch.int32)
    ptrs = state.data_ptrs()
    views = [state.layer(layer) for layer in range(len(rows))]  # taken once, like a graph
    ids = torch.arange(-1, num_logical + 1, dtype=torch.int32).repeat(3, 1)
    snapshot = {name: state.graph_tensors()[name].clone() for name in ("log2phy", "phy2log")}
    snapshot["replica_count"] = state.replica_count.clone()
    committed = [list(r) for r in rows]
    for _ in range(data.draw(st.integers(1, 8))):
        action = data.draw(st.sampled_from(["step", "offset", "reset", "route", "commit"]))
        if action == "step":
            state.set_step_inputs_(data.draw(st.integers(0, 5)), data.draw(st.booleans()))
        elif action == "offset":
            state.advance_offset_(data.draw(st.integers(-5, 2**33)))
        elif action == "reset":
            state.reset_load_()
        elif action == "route":
            for tables in views:
                OPS.map_and_record(
                    ids,
                    tables.log2phy,
                    tables.replica_count,
                    state.offset,
                    tables.load,
                    state.num_valid_tokens,
                    state.record_enabled,
                )
        else:
            layer = data.draw(st.integers(0, len(rows) - 1))
            new_row = data.draw(st.permutations(committed[layer]))
            state.commit_layer_(layer, new_row)
            committed[layer] = list(new_row)
            snapshot = {
                "log2phy": state.log2phy.clone(),
                "phy2log": state.phy2log.clone(),
                "replica_count": state.replica_count.clone(),
            }
        for name, before in snapshot.items():
            assert torch.equal(getattr(state, name), before), (action, name)
        assert_state_matches(state, committed)
        assert state.data_ptrs() == ptrs
        # Routing through the pre-commit views follows the committed placement.
        for layer, tables in enumerate(views):
            out = OPS.map_to_physical(ids, tables.log2phy, tables.replica_count, state.offset)
            for e, slot in zip(ids[0].tolist(), out[0].tolist(), strict=True):
                if 0 <= e < num_logical:
                    assert committed[layer][slot] == e
                else:
                    assert slot == -1


def test_commit_changes_routing_seen_through_old_views():
    state = EplbState(Placement([[0, 1, 2, 3]], 4, 1), max_replicas=2)
    tables = state.layer(0)
    ids = torch.tensor([[0, 1, 2, 3]])
    before = OPS.map_to_physical(ids, tables.log2phy, tables.replica_count, state.offset)
    assert before.tolist() == [[0, 1, 2, 3]]
    state.commit_layer_(0, [3, 2, 1, 0])
    after = OPS.map_to_physical(ids, tables.log2phy, tables.replica_count, state.offset)
    assert after.tolist() == [[3, 2, 1, 0]]


# -- rejected commits write nothing ---------------------------------------------------------------

STATE_ROWS = [[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 2, 3], [0, 1, 2, 3, 3, 2]]

REJECTED_LAYER_COMMITS = [
    pytest.param(1, [0, 1, 2, 3, 0], "layer 1: phy2log row has 5 slots, expected 6", id="short"),
    pytest.param(
        2, [0, 1, 2, 3, 0, 1, 2], "layer 2: phy2log row has 7 slots, expected 6", id="long"
    ),
    pytest.param(
        1,
        [0, 1, 2, 3, 0, 7],
        re.escape("layer 1, slot 5: expert id 7 is out of range [0, 4)"),
        id="id-too-big",
    ),
    pytest.param(
        2,
        [0, -1, 2, 3, 0, 1],
        re.escape("layer 2, slot 1: expert id -1 is out of range [0, 4)"),
        id="negative-id",
    ),
    pytest.param(2, [0, 1, 2, 0, 0, 1], "layer 2: logical expert 3 has no slot", id="missing"),
    pytest.param(
        1,
        [0, 1, 2, 3, 0, 0],
        re.escape("layer 1: expert 0 has 3 replicas but the lookup width R=2"),
        id="too-many-replicas",
    ),
    pytest.param(
        1,
        torch.tensor([0, 1, 2, 3, 0, 1], dtype=torch.float32),
        "phy2log must hold integer expert ids, got dtype torch.float32",
        id="float",
    ),
    pytest.param(3, [0, 1, 2, 3, 0, 1], re.escape("layer must be in [0, 3), got 3"), id="layer"),
    pytest.param(-1, [0, 1, 2, 3, 0, 1], re.escape("layer must be in [0, 3), got -1"), id="neg"),
]


def fresh_state(index_dtype=torch.int64) -> EplbState:
    state = EplbState(Placement(STATE_ROWS, 4, 2), max_replicas=2, index_dtype=index_dtype)
    state.set_step_inputs_(5, record=False)
    state.advance_offset_(17)
    state.load.copy_(torch.arange(18).reshape(3, 6))
    return state


def snapshot(state: EplbState) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in state.graph_tensors().items()}


def assert_untouched(state: EplbState, before: dict[str, torch.Tensor], ptrs) -> None:
    for name, tensor in state.graph_tensors().items():
        assert tensor.dtype == before[name].dtype, name
        assert torch.equal(tensor, before[name]), name
    assert state.data_ptrs() == ptrs
    assert state.placement.phy2log.tolist() == STATE_ROWS


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize(("layer", "row", "message"), REJECTED_LAYER_COMMITS)
def test_rejected_commit_layer_writes_nothing(index_dtype, layer, row, message):
    state = fresh_state(index_dtype)
    before, ptrs = snapshot(state), state.data_ptrs()
    with pytest.raises(PlacementError, match=message):
        state.commit_layer_(layer, row)
    assert_untouched(state, before, ptrs)
    with pytest.raises(PlacementError, match=message):
        state.prepare_layer(layer, row)
    assert_untouched(state, before, ptrs)


REJECTED_COMMITS = [
    pytest.param(
        Placement(STATE_ROWS[:2], 4, 2), "placement has 2 layers, state has 3", id="layers"
    ),
    pytest.param(
        Placement(STATE_ROWS, 4, 1),
        re.escape("placement has (N=4, ranks=1, P=6), state has (N=4, ranks=2, P=6)"),
        id="ranks",
    ),
    pytest.param(
        Placement([[0, 1, 2, 3]] * 3, 4, 2),
        re.escape("placement has (N=4, ranks=2, P=4), state has (N=4, ranks=2, P=6)"),
        id="slots",
    ),
    pytest.param(
        Placement([[0, 1, 2, 0, 1, 2]] * 3, 3, 2),
        re.escape("placement has (N=3, ranks=2, P=6), state has (N=4, ranks=2, P=6)"),
        id="experts",
    ),
    pytest.param(
        Placement([STATE_ROWS[0], STATE_ROWS[1], [0, 1, 2, 3, 3, 3]], 4, 2),
        re.escape("layer 2: expert 3 has 3 replicas but the lookup width R=2"),
        id="too-many-replicas",
    ),
]


@pytest.mark.parametrize(("placement", "message"), REJECTED_COMMITS)
def test_rejected_commit_writes_nothing(placement, message):
    state = fresh_state()
    before, ptrs = snapshot(state), state.data_ptrs()
    with pytest.raises(PlacementError, match=message):
        state.commit_(placement)
    assert_untouched(state, before, ptrs)


def test_committed_placement_is_a_snapshot():
    state = fresh_state()
    old = state.placement
    state.commit_layer_(0, [1, 0, 3, 2, 1, 0])
    assert old.phy2log.tolist() == STATE_ROWS
    assert state.placement.phy2log[0].tolist() == [1, 0, 3, 2, 1, 0]


# -- per-step controls ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "steps", "expected"),
    [
        (0, 1, 1),
        (2**32 - 1, 1, 0),
        (2**32 - 3, 5, 2),
        (5, 2**32, 5),
        (7, 2**40 + 3, 10),
        (0, -1, 2**32 - 1),
        (3, 2**62, 3),
    ],
)
def test_advance_offset_wraps_within_32_bits(start, steps, expected):
    state = EplbState(Placement.default(1, 2, 0, 1))
    ptr = state.offset.data_ptr()
    state.offset.fill_(start)
    state.advance_offset_(steps)
    assert int(state.offset) == expected
    assert 0 <= int(state.offset) < 2**32
    assert state.offset.data_ptr() == ptr and state.offset.dtype == torch.int64


def test_advance_offset_stays_in_range_over_many_steps():
    state = EplbState(Placement.default(1, 4, 4, 2), rank=1)
    state.offset.fill_(2**32 - 10)
    for _ in range(25):
        state.advance_offset_()
        assert 0 <= int(state.offset) < 2**32
    assert int(state.offset) == 15
    state.advance_offset_(0)
    assert int(state.offset) == 15


def test_set_step_inputs_writes_in_place_and_rejects_negative_counts():
    state = EplbState(Placement.default(1, 4, 0, 1))
    ptrs = state.data_ptrs()
    state.set_step_inputs_(7, record=False)
    assert int(state.num_valid_tokens) == 7 and not bool(state.record_enabled)
    state.set_step_inputs_(0, record=True)
    assert int(state.num_valid_tokens) == 0 and bool(state.record_enabled)
    state.set_step_inputs_(3, record=False)
    with pytest.raises(ValueError, match="num_valid_tokens must be >= 0, got -1"):
        state.set_step_inputs_(-1, record=True)
    # Nothing written by the rejected call.
    assert int(state.num_valid_tokens) == 3 and not bool(state.record_enabled)
    assert state.data_ptrs() == ptrs


def test_reset_load_zeroes_in_place():
    state = fresh_state()
    ptr = state.load.data_ptr()
    state.reset_load_()
    assert not state.load.any() and state.load.data_ptr() == ptr


def test_state_never_aliases_the_placement_it_was_built_from():
    """Commits write the state's buffers in place; the caller's Placement must not change."""
    placement = Placement.default(2, 4, 4, 2)
    before = placement.phy2log.clone()
    state = EplbState(placement)
    assert state.phy2log.data_ptr() != placement.phy2log.data_ptr()
    state.commit_layer_(0, torch.tensor([3, 2, 1, 0, 0, 1, 2, 3]))
    assert torch.equal(placement.phy2log, before)
    assert not torch.equal(state.placement.phy2log, before)


def test_offset_seed_defaults_to_the_rank_and_can_be_shared():
    placement = Placement.default(1, 4, 4, 2)
    assert [int(EplbState(placement, rank=r).offset) for r in (0, 1)] == [0, 1]
    shared = [int(EplbState(placement, rank=r, offset_seed=7).offset) for r in (0, 1)]
    assert shared == [7, 7]


def _everything(state: EplbState) -> dict:
    """Every tensor, the version and the host mirror: what an all-or-nothing commit protects."""
    return {
        **{name: tensor.clone() for name, tensor in state.graph_tensors().items()},
        "version": state.placement_version,
        "mirror": state.placement.phy2log.clone(),
    }


def _unchanged(before: dict, state: EplbState) -> bool:
    after = _everything(state)
    return all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        for a, b in zip(before.values(), after.values(), strict=True)
    )


@pytest.mark.parametrize(
    "layer", [True, False, torch.tensor(True), 1.0, "1", -1, 3, torch.tensor([1])]
)
def test_a_layer_that_is_not_an_index_commits_nothing(layer):
    state = EplbState(Placement.default(3, 4, 4, 2))
    before = _everything(state)
    with pytest.raises(PlacementError, match="layer must be"):
        state.commit_layer_(layer, torch.tensor([3, 2, 1, 0, 0, 1, 2, 3]))
    assert _unchanged(before, state)


def test_integers_of_every_kind_are_layer_indices():
    state = EplbState(Placement.default(3, 4, 4, 2))
    row = torch.tensor([3, 2, 1, 0, 0, 1, 2, 3])
    for layer in (1, np.int64(1), torch.tensor(1)):
        state.commit_layer_(layer, row)
    assert torch.equal(state.placement.phy2log[1], row)


def test_only_tables_this_state_prepared_are_committed_and_nothing_is_written_otherwise():
    state = EplbState(Placement.default(2, 4, 4, 2))
    other = EplbState(Placement.default(2, 4, 4, 2))
    row = torch.tensor([3, 2, 1, 0, 0, 1, 2, 3])
    prepared = state.prepare_layer(1, row)
    forged = PreparedLayer(1, prepared.phy2log, prepared.log2phy.flip(0), prepared.replica_count)
    before = _everything(state)
    malformed = [
        tuple(vars(prepared).values()),  # the old tuple form
        forged,  # right shapes, inconsistent tables, not made by prepare_layer
        other.prepare_layer(1, row),  # made by another state
    ]
    for bad in malformed:
        with pytest.raises(PlacementError, match="prepare_layer made"):
            state.commit_prepared_(1, bad)
        assert _unchanged(before, state)
    with pytest.raises(PlacementError, match="prepared for layer 1 cannot be committed to layer 0"):
        state.commit_prepared_(0, prepared)
    assert _unchanged(before, state)
    state.commit_prepared_(1, prepared)
    assert torch.equal(state.placement.phy2log[1], row)


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ((2.7, True), "num_valid_tokens must be an integer"),
        ((True, True), "num_valid_tokens must be an integer, got the boolean"),
        ((-1, True), "num_valid_tokens must be >= 0"),
        ((4, "no"), "record must be True or False"),
        ((4, 1), "record must be True or False"),
        ((4, None), "record must be True or False"),
    ],
)
def test_step_inputs_are_not_coerced(arguments, match):
    state = EplbState(Placement.default(1, 4, 0, 2))
    before = _everything(state)
    with pytest.raises(EplbStateError, match=match):
        state.set_step_inputs_(*arguments)
    assert _unchanged(before, state)


@pytest.mark.parametrize(
    ("keywords", "match"),
    [
        ({"rank": True}, "rank must be an integer, got the boolean"),
        ({"rank": 1.0}, "rank must be an integer"),
        ({"max_replicas": 2.5}, "max_replicas must be an integer"),
        ({"offset_seed": True}, "offset_seed must be an integer"),
        ({"offset_seed": -1}, "offset_seed must be >= 0"),
    ],
)
def test_state_construction_arguments_are_not_coerced(keywords, match):
    with pytest.raises(EplbStateError, match=match):
        EplbState(Placement.default(1, 4, 4, 2), **keywords)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: Placement([[0, 1]], True, 1), "num_logical must be an integer, got the boolean"),
        (lambda: Placement([[0, 1]], 2, 1.0), "num_ranks must be an integer"),
        (lambda: Placement.default(True, 4, 0, 2), "num_layers must be an integer"),
        (lambda: Placement.default(1, 4, 0, 10**30), "num_ranks must be <="),
        (lambda: Placement.default(1, 4, 0, 2).log2phy(2.5), "max_replicas must be an integer"),
        (lambda: Placement.default(2, 4, 0, 2).with_layer(-1, [0, 1, 2, 3]), "layer must be in"),
    ],
)
def test_placement_arguments_are_not_coerced(call, match):
    with pytest.raises(PlacementError, match=match):
        call()
