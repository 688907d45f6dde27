"""Weight views: packing, in-place unpacking, address stability and rejection, per format.

Tensors are filled so every (layer, tensor, expert, element) is distinguishable: random values
from a generator seeded per (layer, tensor), never constants, so a swapped expert, a stale scale
or a misplaced block changes the bytes. Equality checks are bit-exact (``torch.equal`` on data
without NaNs, plus byte-for-byte payload comparison).
"""

from __future__ import annotations

import pytest
import torch

from eplb_graph.movement import (
    ExpertWeightView,
    InternalLayoutView,
    PackedSlotView,
    StridedPackedView,
    UnquantizedView,
    UnsupportedWeightFormat,
    W8A8View,
    WeightViewError,
    from_nd,
    make_expert_view,
    plan_transfer,
    supported_formats,
    to_nd,
)
from tests import movement_fixtures as fixtures
from tests.movement_fixtures import fill

S = 4  # slots per view (hidden and intermediate sizes come from the shared fixtures)
H, INTER = fixtures.HIDDEN, fixtures.INTER


def make_tensors(format_name: str, layer: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Live tensors (and options) of one layer in ``format_name``, distinguishable everywhere."""
    return fixtures.make_tensors(format_name, S, seed=layer * 100)


FORMATS = supported_formats()


def build(format_name: str, layer: int = 0) -> PackedSlotView:
    tensors, options = make_tensors(format_name, layer)
    view = make_expert_view(format_name, tensors, **options)
    assert isinstance(view, ExpertWeightView)
    return view


def snapshot(view: PackedSlotView) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in {**view.tensors(), **view.unmoved_tensors()}.items()}


def packed(view: PackedSlotView, slot: int) -> torch.Tensor:
    out = torch.empty(view.slot_nbytes, dtype=torch.uint8)
    view.pack_slot(slot, out)
    return out


def expert_slice(view: PackedSlotView, name: str, tensor: torch.Tensor, slot: int):
    """The part of a full tensor that belongs to ``slot`` (any format)."""
    if view.format_name == "strided_packed":
        return tensor.select(1, slot)
    return tensor[slot]


def test_registry_lists_every_shipped_format():
    assert set(FORMATS) >= {
        "unquantized",
        "unquantized_nz",
        "w8a8",
        "w8a8_nz",
        "w4a8",
        "w4a8_nz",
        "strided_packed",
        "nz",
    }


@pytest.mark.parametrize("format_name", FORMATS)
def test_pack_unpack_round_trip_moves_slots_bit_exactly_in_place(format_name):
    source, target = build(format_name, layer=1), build(format_name, layer=2)
    assert source.slot_nbytes == target.slot_nbytes and source.slot_nbytes % 16 == 0
    original, before = snapshot(source), snapshot(target)
    ptrs = target.data_ptrs()
    # payloads of distinct slots and layers differ (values are distinguishable)
    payloads = [packed(source, s) for s in range(S)] + [packed(target, s) for s in range(S)]
    assert len({bytes(p.numpy()) for p in payloads}) == 2 * S
    permutation = [2, 0, 3, 1]
    for slot, src_slot in enumerate(permutation):
        target.unpack_slot_(slot, payloads[src_slot])
    for name, tensor in target.tensors().items():
        for slot, src_slot in enumerate(permutation):
            got = expert_slice(target, name, tensor, slot)
            want = expert_slice(source, name, original[name], src_slot)
            assert torch.equal(got, want), (name, slot)
    for slot, src_slot in enumerate(permutation):  # byte-exact payloads after the move
        assert torch.equal(packed(target, slot), payloads[src_slot])
    assert target.data_ptrs() == ptrs
    for name, tensor in target.unmoved_tensors().items():  # offsets are never written
        assert torch.equal(tensor, before[name]), name
    for name, tensor in source.tensors().items():  # packing only reads
        assert torch.equal(tensor, original[name])


@pytest.mark.parametrize("format_name", FORMATS)
def test_data_ptrs_never_change_over_many_unpacks(format_name):
    view = build(format_name)
    ptrs = view.data_ptrs()
    tensors = view.tensors()
    staging = torch.empty(S, view.slot_nbytes, dtype=torch.uint8)  # staging rows stay aligned
    for round_ in range(5):
        for slot in range(S):
            view.pack_slot(slot, staging[slot])
        for slot in range(S):
            view.unpack_slot_(slot, staging[(slot + round_) % S])
    assert view.data_ptrs() == ptrs
    assert all(view.tensors()[k] is v for k, v in tensors.items())


def test_w8a8_offsets_are_not_part_of_the_payload():
    tensors, _ = make_tensors("w8a8", 0)
    view = W8A8View(**tensors)
    assert "w13_offset" not in view.payload_names and "w2_offset" not in view.payload_names
    assert set(view.tensors()) == {
        "w13",
        "w2",
        "w13_scale",
        "w2_scale",
        "w13_fused_scale",
        "w2_fused_scale",
    }
    assert set(view.unmoved_tensors()) == {"w13_offset", "w2_offset"}
    assert set(view.data_ptrs()) == set(view.tensors()) | set(view.unmoved_tensors())
    moved_bytes = sum(
        t[0].numel() * t.element_size() for k, t in tensors.items() if not k.endswith("offset")
    )
    assert view.slot_nbytes == moved_bytes  # every section here is already 16-byte aligned
    without_offsets = W8A8View(**{k: v for k, v in tensors.items() if not k.endswith("offset")})
    assert without_offsets.slot_nbytes == view.slot_nbytes


def test_w4a8_moves_scale_bias_with_the_weights():
    view = build("w4a8")
    assert view.payload_names == (
        "w13",
        "w2",
        "w13_scale",
        "w2_scale",
        "w13_fused_scale",
        "w2_fused_scale",
        "w13_scale_bias",
        "w2_scale_bias",
    )
    assert view.tensors()["w13"].shape == (S, 2 * INTER, H // 2)  # int4 packed two per int8


def test_payload_sections_are_aligned_and_padding_is_zero():
    w13 = fill((S, 6, 3), torch.float16, 1)  # 36-byte and 18-byte sections need padding
    w2 = fill((S, 3, 3), torch.float16, 2)
    view = UnquantizedView(w13, w2)
    assert [s.offset % 16 for s in view.sections] == [0, 0]
    assert view.slot_nbytes == 48 + 32
    out = torch.full((view.slot_nbytes,), 0xAB, dtype=torch.uint8)
    view.pack_slot(1, out)
    assert out[36:48].eq(0).all() and out[48 + 18 :].eq(0).all()
    assert torch.equal(out[:36].view(torch.float16).view(6, 3), w13[1])


def test_strided_view_writes_into_the_original_storage():
    tensors, options = make_tensors("strided_packed", 0)
    base = tensors["w13"]
    alias = base.view(H * S, 2 * INTER)  # a second view of the same storage
    view = StridedPackedView(tensors, **options)
    assert not view.slot_tensor("w13", 1).is_contiguous()
    ptr = base.data_ptr()
    payload = packed(view, 3)
    expected = base[:, 3, :].clone()
    view.unpack_slot_(1, payload)
    assert base.data_ptr() == ptr
    assert torch.equal(base[:, 1, :], expected)
    assert torch.equal(alias.view(H, S, 2 * INTER)[:, 1, :], expected)
    assert torch.equal(
        payload[: H * 2 * INTER * 2].view(torch.float16).view(H, 2 * INTER), expected
    )  # the payload holds the slot contiguously (ND)


def test_expert_dim_per_tensor_for_strided_view():
    a = fill((S, 8), torch.float32, 1)  # expert dim 0
    b = fill((8, 2, S), torch.float32, 2)  # expert dim 2
    view = StridedPackedView({"a": a, "b": b}, expert_dim={"a": 0, "b": -1})
    b_before = b.clone()
    view.unpack_slot_(0, packed(view, 2))
    assert torch.equal(b[..., 0], b_before[..., 2]) and torch.equal(a[0], a[2])


@pytest.mark.parametrize(
    ("rows", "cols", "h0", "f0"), [(32, 64, 16, 16), (16, 32, 16, 32), (48, 8, 16, 8)]
)
def test_nz_round_trip(rows, cols, h0, f0):
    nd = fill((3, rows, cols), torch.float32, rows + cols)
    block = from_nd(nd, h0, f0)
    assert block.shape == (3, cols // f0, rows // h0, h0, f0) and block.is_contiguous()
    # the layout really is blocked: block (fb, hb) holds nd[hb*h0:(hb+1)*h0, fb*f0:(fb+1)*f0]
    assert torch.equal(block[1, 1 % (cols // f0), 0], nd[1, :h0, (1 % (cols // f0)) * f0 :][:, :f0])
    back = to_nd(block)
    assert back.is_contiguous() and torch.equal(back, nd)
    assert torch.equal(from_nd(to_nd(block), h0, f0), block)


def test_nz_pack_is_the_nd_form_and_unpack_writes_the_original_nz_storage():
    tensors, options = make_tensors("nz", 0)
    w13 = tensors["w13"]
    alias = w13.view(-1)  # a second view of the NZ storage
    view = InternalLayoutView(tensors, **options)
    ptr = w13.data_ptr()
    section = view.sections[0]
    payload = packed(view, 2)
    nd_slot = payload[section.offset : section.offset + section.nbytes].view(torch.float16)
    assert torch.equal(nd_slot.view(2 * INTER, H), to_nd(w13[2]))  # pack == to_nd of the NZ block
    expected = w13[2].clone()
    neighbours = w13[[1, 3]].clone()
    view.unpack_slot_(0, payload)
    assert w13.data_ptr() == ptr
    assert torch.equal(w13[0], expected)
    assert torch.equal(alias.view_as(w13)[0], expected)
    assert torch.equal(w13[[1, 3]], neighbours)  # neighbouring experts' blocks untouched


def test_execute_local_over_packed_payloads_of_a_real_format():
    """Three ranks of W8A8 (NZ weights): stage payloads, run the plan, unpack changed slots."""
    num_ranks, spr = 3, S
    old = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    new = [1, 0, 9, 3, 9, 5, 4, 7, 8, 0, 2, 2]  # swap in rank 0, cycles, duplicates on rank 2
    expert_data = {}  # expert -> packed payload (every replica of an expert holds the same data)
    views = []
    for rank in range(num_ranks):
        view = build("w8a8_nz", layer=10 + rank)
        for slot in range(spr):
            expert = old[rank * spr + slot]
            if expert in expert_data:
                view.unpack_slot_(slot, expert_data[expert])
            else:
                expert_data[expert] = packed(view, slot)
        views.append(view)
    ptrs = [v.data_ptrs() for v in views]
    offsets = [{k: t.clone() for k, t in v.unmoved_tensors().items()} for v in views]
    buffers = [torch.stack([packed(v, s) for s in range(spr)]) for v in views]
    plan = plan_transfer(old, new, num_ranks)
    plan.execute_local(buffers)
    changed = set(plan.changed_slots())
    for rank, view in enumerate(views):
        for slot in range(spr):
            if rank * spr + slot in changed:
                view.unpack_slot_(slot, buffers[rank][slot])
    for rank, view in enumerate(views):
        assert view.data_ptrs() == ptrs[rank]
        for slot in range(spr):
            assert torch.equal(packed(view, slot), expert_data[new[rank * spr + slot]]), (
                rank,
                slot,
            )
        for name, tensor in view.unmoved_tensors().items():
            assert torch.equal(tensor, offsets[rank][name])


# -- rejection --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mxfp4_swizzled", "nz_whole_tensor_only"])
def test_known_unsupported_formats_are_rejected_by_name(name):
    with pytest.raises(UnsupportedWeightFormat, match=name) as info:
        make_expert_view(name, make_tensors("unquantized", 0)[0])
    assert info.value.format_name == name and info.value.reason


def test_unknown_format_is_rejected_listing_the_supported_ones():
    with pytest.raises(UnsupportedWeightFormat, match=r"'fp8_magic'.*supported formats: .*w8a8"):
        make_expert_view("fp8_magic", {})


def _w8a8(**changes):
    tensors = make_tensors("w8a8", 0)[0]
    tensors.update(changes)
    return {k: v for k, v in tensors.items() if v is not None}


@pytest.mark.parametrize(
    ("format_name", "tensors", "options", "message"),
    [
        ("w8a8", _w8a8(w2_scale=None), {}, r"missing tensors \['w2_scale'\]"),
        ("w8a8", _w8a8(w13_zero=torch.zeros(S)), {}, "unexpected tensors"),
        ("w8a8", _w8a8(w13=torch.zeros(S, 2 * INTER, H)), {}, "'w13' must have dtype torch.int8"),
        ("w8a8", _w8a8(w2_scale=torch.zeros(S + 1, H)), {}, "leading dimension"),
        ("w8a8", _w8a8(w13_scale=torch.zeros(2 * INTER)), {}, "missing expert dimension"),
        ("w8a8", _w8a8(w2_fused_scale=torch.zeros(S, H)), {}, "torch.int64"),
        ("w8a8", _w8a8(w13_scale=torch.zeros(S, 3)), {}, "output channels"),
        ("w8a8", _w8a8(), {"expert_dim": 1}, "unknown options"),
        (
            "unquantized",
            {
                "w13": torch.zeros(S, 2 * INTER, H, dtype=torch.float16),
                "w2": torch.zeros(S, H, INTER),
            },
            {},
            "'w2' is torch.float32 but 'w13' is torch.float16",
        ),
        (
            "unquantized",
            {"w13": torch.zeros(S, 2 * INTER, H), "w2": torch.zeros(S, H, INTER + 1)},
            {},
            "gate\\+up rows",
        ),
        (
            "unquantized",
            {"w13": torch.zeros(1, 2 * INTER, H).expand(S, -1, -1), "w2": torch.zeros(S, H, INTER)},
            {},
            "stride-0",
        ),
        (
            "unquantized",
            {
                "w13": torch.zeros(S, 2 * INTER, H, device="meta"),
                "w2": torch.zeros(S, H, INTER, device="meta"),
            },
            {},
            "meta",
        ),
        (
            "unquantized_nz",
            {"w13": torch.zeros(S, 2 * INTER, H), "w2": torch.zeros(S, H, INTER)},
            {},
            "NZ",
        ),
        (
            "strided_packed",
            {"w": torch.zeros(H, S, INTER)},
            {"expert_dim": 3},
            "no expert dimension",
        ),
        (
            "strided_packed",
            {"a": torch.zeros(H, S, INTER), "b": torch.zeros(H, S + 1)},
            {},
            "experts along dim 1",
        ),
        ("nz", {"w13": torch.zeros(S, 2, 2, 16, 16)}, {"nz_names": ("w2",)}, "not given"),
        ("nz", {"w13": torch.zeros(S, 32, 32)}, {"nz_names": ("w13",)}, "fractal NZ"),
    ],
)
def test_tensors_that_do_not_fit_the_format_are_rejected_at_construction(
    format_name, tensors, options, message
):
    with pytest.raises(UnsupportedWeightFormat, match=message) as info:
        make_expert_view(format_name, tensors, **options)
    assert info.value.format_name.startswith(format_name.split("_nz")[0])


def test_a_getter_that_returns_a_copy_is_rejected():
    live = torch.zeros(S, 8)
    with pytest.raises(UnsupportedWeightFormat, match="not a view of the live tensor"):
        PackedSlotView("custom", S, [("w", lambda slot: live[slot].clone())], live={"w": live})


def test_a_generic_packed_view_from_name_getter_pairs():
    live = fill((S, 8), torch.float32, 3)
    view = PackedSlotView("custom", S, [("w", live.__getitem__)], live={"w": live})
    before = live.clone()
    view.unpack_slot_(0, packed(view, 3))
    assert torch.equal(live[0], before[3]) and torch.equal(live[1:], before[1:])


@pytest.mark.parametrize(
    ("slot", "buffer", "message"),
    [
        (S, None, "out of range"),
        (-1, None, "out of range"),
        (True, None, "must be an int"),
        (0, torch.zeros(8, dtype=torch.uint8), "uint8"),
        (0, "float", "uint8"),
        (0, "strided", "contiguous"),
        (0, "misaligned", "aligned"),
    ],
)
def test_bad_pack_and_unpack_calls_raise_before_writing(slot, buffer, message):
    view = build("w8a8")
    n = view.slot_nbytes
    buffer = (
        {
            None: torch.zeros(n, dtype=torch.uint8),
            "float": torch.zeros(n, dtype=torch.float32),
            "strided": torch.zeros(2 * n, dtype=torch.uint8)[::2],
            "misaligned": torch.zeros(n + 8, dtype=torch.uint8)[8:],
        }.get(buffer, buffer)
        if not isinstance(buffer, torch.Tensor)
        else buffer
    )
    before = snapshot(view)
    with pytest.raises(WeightViewError, match=message):
        view.unpack_slot_(slot, buffer)
    with pytest.raises(WeightViewError, match=message):
        view.pack_slot(slot, buffer)
    assert all(torch.equal(t, before[k]) for k, t in snapshot(view).items())


def test_views_write_into_parameters_that_require_grad():
    """Model weights are ``nn.Parameter``s; movement must write them in place, not rebind."""
    w13 = torch.nn.Parameter(fill((S, 2 * INTER, H), torch.float32, 7))
    w2 = torch.nn.Parameter(fill((S, H, INTER), torch.float32, 8))
    view = make_expert_view("unquantized", {"w13": w13, "w2": w2})
    expected = w13[3].detach().clone()
    view.unpack_slot_(0, packed(view, 3))
    assert view.tensors()["w13"] is w13 and torch.equal(w13[0].detach(), expected)
