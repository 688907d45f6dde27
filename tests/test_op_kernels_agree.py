"""Every kernel of the routing ops gives the same answer, or the same error, on any input.

The kernels compared, on seeded random inputs that include every hostile class the schema
allows (out-of-range ids, table entries and counts, extreme offsets and valid-token counts,
empty and size-1 dimensions, strided views, mixed dtypes) and on inputs that must be rejected
(a load that is empty, stride-0 or overlapping another input, wrong dtypes, ranks and devices):

- ``native``: ``torch.ops.eplb_graph.*`` on CPU tensors (the fused C++ kernel);
- ``reference``: ``eplb_graph.ops.reference.*_ref`` called directly (the ATen oracle);
- ``fake``: the op under ``FakeTensorMode`` (the checks torch.compile traces with);
- ``compiled``: ``torch.compile(backend="inductor")``, where the op stays one extern call to the
  native kernel;
- ``decomposed``: the same with the op decomposed into the reference and lowered by inductor, as
  on every device without a native kernel.

Results must be identical: output values, dtype and shape, and ``load`` after the call; or, for a
rejected input, a ``RuntimeError`` with the same message from every kernel, raised before
``load`` is written.
"""

from __future__ import annotations

import random
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from torch._inductor.graph import GraphLowering
from torch._subclasses.fake_tensor import FakeTensorMode

from eplb_graph.ops import inductor as lowering
from eplb_graph.ops import native
from eplb_graph.ops.reference import map_and_record_ref, map_to_physical_ref, record_load_ref

OPS = torch.ops.eplb_graph
ARGS = {
    "map_to_physical": ("topk_ids", "log2phy", "replica_count", "offset"),
    "record_load": ("load", "physical_ids", "num_valid_tokens", "record_enabled"),
    "map_and_record": (
        "topk_ids",
        "log2phy",
        "replica_count",
        "offset",
        "load",
        "num_valid_tokens",
        "record_enabled",
    ),
}
REFERENCE = {
    "map_to_physical": map_to_physical_ref,
    "record_load": record_load_ref,
    "map_and_record": map_and_record_ref,
}
I16, I32, I64, U8 = torch.int16, torch.int32, torch.int64, torch.uint8
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@pytest.fixture(scope="module", autouse=True)
def _native_kernel():
    if not native.ensure_loaded():
        pytest.fail(f"native CPU kernel unavailable: {native.failure_reason()}")


# -- outcomes -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What one kernel did: its output and the load after the call, or its error message."""

    output: tuple | None = None
    load: tuple | None = None
    error: str | None = None


def _describe(tensor: torch.Tensor | None) -> tuple | None:
    if tensor is None:
        return None
    return (tensor.dtype, tuple(tensor.shape), tuple(tensor.reshape(-1).tolist()))


def run_kernel(kernel: Callable, op: str, inputs: dict[str, torch.Tensor]) -> Outcome:
    """Call ``kernel`` on private copies of ``inputs`` (aliasing between them kept)."""
    args = _copy_keeping_aliases([inputs[name] for name in ARGS[op]])
    load = args[ARGS[op].index("load")] if "load" in ARGS[op] else None
    try:
        output = kernel(*args)
    except RuntimeError as error:
        if load is not None and load.device.type == "cpu":
            assert torch.equal(load, inputs["load"]), "a rejected call wrote load"
        return Outcome(error=str(error))
    return Outcome(_describe(output), _describe(load))


def _copy_keeping_aliases(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh copies; views of one storage stay views of one (new) storage, strides kept."""
    storages: dict[int, torch.Tensor] = {}
    copies = []
    for tensor in tensors:
        if tensor.device.type != "cpu":
            copies.append(tensor.clone())
            continue
        key = tensor.untyped_storage().data_ptr()
        if key not in storages:
            base = torch.empty(0, dtype=torch.uint8)
            base.set_(tensor.untyped_storage().clone())
            storages[key] = base
        base = storages[key]
        view = torch.empty(0, dtype=tensor.dtype)
        view.set_(base.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
        copies.append(view)
    return copies


def fake_kernel(op: str) -> Callable:
    """The op under FakeTensorMode: what torch.compile traces, checks included."""

    def call(*args):
        mode = FakeTensorMode()
        fakes = [mode.from_tensor(t) for t in args]
        with mode:
            out = getattr(OPS, op)(*fakes)
        return None if out is None else torch.zeros(out.shape, dtype=out.dtype)

    return call


class Compiled:
    """One ``torch.compile(backend="inductor", dynamic=True)`` of the op, kept across cases.

    ``decomposed`` lowers the op through its reference decomposition (the non-native branch of
    ``eplb_graph.ops.inductor``). The FX graph cache is bypassed: it keys on the graph, not on
    that lowering choice. A recompile-limit hit fails instead of silently running eager.
    """

    def __init__(self, op: str, *, decomposed: bool):
        self.decomposed = decomposed
        self.name = op
        self.fn = torch.compile(_op_caller(op, decomposed), backend="inductor", dynamic=True)
        self.sources: list[str] = []  # the code of every graph compiled so far

    def assert_lowered_as_intended(self) -> None:
        """Guards against a lowering that silently went the other way (then nothing differs)."""
        assert self.sources, "nothing was compiled"
        extern = [f"torch.ops.eplb_graph.{self.name}.default(" in code for code in self.sources]
        assert extern == [not self.decomposed] * len(self.sources), self.decomposed

    def __call__(self, *args):
        with (
            torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True),
            torch._inductor.config.patch(fx_graph_cache=False),
            torch.fx.experimental._config.patch(use_duck_shape=False),
        ):
            previous = lowering.keep_opaque
            if self.decomposed:
                lowering.keep_opaque = lambda device: False
            try:
                # What run_and_get_code does, without its dynamo reset (which recompiles).
                with mock.patch.object(GraphLowering, "save_output_code", self.sources.append):
                    return self.fn(*args)
            finally:
                lowering.keep_opaque = previous


def _op_caller(op: str, decomposed: bool) -> Callable:
    """A function calling the op, with its own code object: dynamo caches graphs per code object,
    so two lowerings of one op must not share one (the second would reuse the first's graphs)."""
    handle = getattr(OPS, op)

    def call(*args):
        return handle(*args)

    name = f"{op}_{'decomposed' if decomposed else 'extern'}"
    code = call.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, call.__globals__, name, closure=call.__closure__)


@pytest.fixture(scope="module")
def compiled_kernels():
    torch._dynamo.reset()
    kernels = {
        (op, decomposed): Compiled(op, decomposed=decomposed)
        for op in ARGS
        for decomposed in (False, True)
    }
    yield kernels
    torch._dynamo.reset()


def _sizes_masked(message: str) -> str:
    return re.sub(r"\b(s\d+|\d+)\b", "#", message)


def assert_same_outcome(outcomes: dict[str, Outcome]) -> None:
    """Identical results; for errors, the eager kernels' message, which compiled ones wrap."""
    expected = outcomes["reference"]
    for name, outcome in outcomes.items():
        if expected.error is None:
            assert outcome == expected, (name, outcome, expected)
            continue
        assert outcome.error is not None, (name, "no error", expected.error)
        first_line = expected.error.splitlines()[0]
        if name.startswith(("compiled", "decomposed")):
            # Dynamo wraps the message; sizes in it may be symbols (s10) under dynamic shapes.
            assert _sizes_masked(first_line) in _sizes_masked(outcome.error), (name, outcome.error)
        else:
            assert outcome.error.splitlines()[0] == first_line, (name, outcome.error, first_line)


# -- random inputs --------------------------------------------------------------------------------

# Dtype families (ids, table, count, load, num_valid_tokens) and strided or not. Each is one set
# of compile guards; values vary freely within it.
FAMILIES = {
    "int64": ((I64, I64, I64, I64, I64), False),
    "mixed-strided": ((I32, I64, I32, I32, I16), True),
    "narrow-table": ((I64, I32, I64, I64, U8), True),
}


def _pick(rng: random.Random, common: Callable[[], int], rare: list[int], p_rare=0.25) -> int:
    return rng.choice(rare) if rare and rng.random() < p_rare else common()


def _fit(value: int, dtype: torch.dtype) -> int:
    info = torch.iinfo(dtype)
    return min(max(value, info.min), info.max)


def _strided(values: torch.Tensor, strided: bool) -> torch.Tensor:
    """``values`` itself, or an equal non-contiguous view of a bigger tensor."""
    if not strided or values.dim() == 0:
        return values
    big = torch.full((*values.shape[:-1], values.shape[-1] * 2), 77, dtype=values.dtype)
    big[..., ::2] = values
    return big[..., ::2]


def random_inputs(
    rng: random.Random, family: str, *, rows: int, top_k: int, experts: int, width: int, slots: int
) -> dict[str, torch.Tensor]:
    """One case with hostile values mixed in (about a quarter of every tensor's elements)."""
    (ids_t, table_t, count_t, load_t, valid_t), strided = FAMILIES[family]
    ids_info, table_info = torch.iinfo(ids_t), torch.iinfo(table_t)
    bad_ids = [-1, -5, experts, experts + 3, ids_info.min, ids_info.max]
    bad_entries = [-1, -1, -7, slots, slots + 5, table_info.min, table_info.max]
    if table_t == I64:
        bad_entries += [2**31 - 1, 2**31, 2**32 + 1, -(2**32) + 3]
    bad_counts = [0, -1, -(2**31), width + 1, 2**31 - 1]
    if count_t == I64:
        bad_counts += [2**32, 2**32 + 1, 2**40, INT64_MIN, INT64_MAX]
    ids = [_pick(rng, lambda: rng.randrange(experts), bad_ids) for _ in range(rows * top_k)]
    table = [_pick(rng, lambda: rng.randrange(slots), bad_entries) for _ in range(experts * width)]
    counts = [_pick(rng, lambda: rng.randint(1, width), bad_counts) for _ in range(experts)]
    offset = _pick(
        rng,
        lambda: rng.randrange(-(2**40), 2**40),
        [0, 2**32 - 1, 2**32, INT64_MIN, INT64_MAX, INT64_MAX - rows, -(2**62) - 3],
        p_rare=0.5,
    )
    valid = _fit(
        _pick(rng, lambda: rng.randint(-2, rows + 2), [-(2**15), 2**15 - 1, INT64_MIN, INT64_MAX]),
        valid_t,
    )
    load_max = torch.iinfo(load_t).max
    load = [_pick(rng, lambda: rng.randrange(9), [load_max, load_max - 1]) for _ in range(slots)]
    physical = [_pick(rng, lambda: rng.randrange(slots), bad_entries) for _ in ids]
    return {
        "topk_ids": _strided(torch.tensor(ids, dtype=ids_t).reshape(rows, top_k), strided),
        "physical_ids": _strided(
            torch.tensor([_fit(p, ids_t) for p in physical], dtype=ids_t).reshape(rows, top_k),
            strided,
        ),
        "log2phy": _strided(torch.tensor(table, dtype=table_t).reshape(experts, width), strided),
        "replica_count": _strided(torch.tensor(counts, dtype=count_t), strided),
        "offset": torch.tensor(offset, dtype=I64),
        "load": _strided(torch.tensor(load, dtype=load_t), strided),
        "num_valid_tokens": torch.tensor(valid, dtype=valid_t),
        "record_enabled": torch.tensor(rng.random() < 0.8),
    }


def general_case(rng: random.Random, family: str) -> dict[str, torch.Tensor]:
    """Every dimension at least 2: one dynamic-shape graph serves all of them."""
    return random_inputs(
        rng,
        family,
        rows=rng.randint(2, 24),
        top_k=rng.randint(2, 8),
        experts=rng.randint(2, 9),
        width=rng.randint(2, 4),
        slots=rng.randint(2, 40),
    )


# Sizes of 0 and 1 (specialized by the compiler, and the edges of every loop).
EDGE_SHAPES = [
    {"rows": 0, "top_k": 8, "experts": 3, "width": 2, "slots": 4},
    {"rows": 1, "top_k": 8, "experts": 3, "width": 2, "slots": 4},
    {"rows": 5, "top_k": 0, "experts": 3, "width": 2, "slots": 4},
    {"rows": 5, "top_k": 1, "experts": 1, "width": 1, "slots": 1},
]


def kernels_for(op: str, compiled_kernels, *, decomposed: bool) -> dict[str, Callable]:
    kernels = {
        "reference": REFERENCE[op],
        "native": getattr(OPS, op),
        "compiled": compiled_kernels[(op, False)],
    }
    if decomposed:
        kernels["decomposed"] = compiled_kernels[(op, True)]
    return kernels


@pytest.mark.parametrize("op", list(ARGS))
def test_kernels_agree_on_random_hostile_inputs(op, compiled_kernels):
    rng = random.Random(f"{op}-kernels-agree")
    for family in FAMILIES:
        # The decomposed (inductor C++) build is the slow one: one family covers its branches.
        kernels = kernels_for(op, compiled_kernels, decomposed=family == "mixed-strided")
        for _ in range(40):
            inputs = general_case(rng, family)
            outcomes = {name: run_kernel(kernel, op, inputs) for name, kernel in kernels.items()}
            assert outcomes["reference"].error is None, outcomes["reference"].error
            assert_same_outcome(outcomes)
    compiled_kernels[(op, False)].assert_lowered_as_intended()
    compiled_kernels[(op, True)].assert_lowered_as_intended()


@pytest.mark.parametrize("shape", EDGE_SHAPES, ids=lambda s: "-".join(map(str, s.values())))
@pytest.mark.parametrize("op", ["map_to_physical", "map_and_record", "record_load"])
def test_kernels_agree_on_empty_and_size_one_dimensions(op, shape, compiled_kernels):
    rng = random.Random(f"{op}-{shape}")
    kernels = kernels_for(op, compiled_kernels, decomposed=False)
    kernels["fake"] = fake_kernel(op)
    for family in ("int64", "mixed-strided"):
        inputs = random_inputs(rng, family, **shape)
        outcomes = {name: run_kernel(kernel, op, inputs) for name, kernel in kernels.items()}
        assert outcomes["reference"].error is None, outcomes["reference"].error
        fake = outcomes.pop("fake")
        assert fake.error is None
        assert (fake.output or ())[:2] == (outcomes["reference"].output or ())[:2]
        assert_same_outcome(outcomes)


# -- rejected inputs ------------------------------------------------------------------------------


def valid_inputs() -> dict[str, torch.Tensor]:
    return {
        "topk_ids": torch.tensor([[0, 1], [2, 0]]),
        "physical_ids": torch.tensor([[0, 3], [1, 2]]),
        "log2phy": torch.tensor([[0, 3], [1, -1], [2, -1]]),
        "replica_count": torch.tensor([2, 1, 1]),
        "offset": torch.tensor(0),
        "load": torch.zeros(4, dtype=torch.int64),
        "num_valid_tokens": torch.tensor(2),
        "record_enabled": torch.tensor(True),
    }


def _load_inside(name: str, load_start: int = 0) -> Callable[[dict], None]:
    """Put ``load`` in the same storage as input ``name`` (overlapping it from ``load_start``)."""

    def breaker(inputs: dict) -> None:
        other = inputs[name]
        flat = other.reshape(-1)
        buffer = torch.zeros(flat.numel() + 8, dtype=other.dtype)
        buffer[: flat.numel()] = flat
        inputs[name] = buffer[: flat.numel()].view(other.shape)
        inputs["load"] = buffer[load_start : load_start + 4]

    return breaker


def _set(name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    def breaker(inputs: dict) -> None:
        inputs[name] = make(inputs[name])

    return breaker


# (case id, the argument it breaks, how, a part of the message, also run it compiled). Compiling
# costs a trace per case, so the compiled kernel sees the classes fake alone does not settle.
REJECTED = [
    ("expanded", "load", _set("load", lambda t: t[:1].expand(4)), "slots in one memory cell", 1),
    ("stride0", "load", _set("load", lambda t: t.as_strided((3,), (0,))), "several slots", 0),
    ("empty", "load", _set("load", lambda t: t[:0]), "load should have at least one slot", 1),
    ("empty-int32", "load", _set("load", lambda t: t[:0].int()), "at least one slot", 0),
    ("in-log2phy", "log2phy", _load_inside("log2phy", 2), "load shares memory with log2phy", 1),
    ("in-topk_ids", "topk_ids", _load_inside("topk_ids"), "shares memory with topk_ids", 0),
    ("in-physical_ids", "physical_ids", _load_inside("physical_ids", 1), "with physical_ids", 1),
    ("in-count", "replica_count", _load_inside("replica_count"), "with replica_count", 0),
    ("in-offset", "offset", _load_inside("offset"), "load shares memory with offset", 0),
    ("2d", "load", _set("load", lambda t: t.reshape(2, 2)), "load should be a 1d tensor", 0),
    ("float", "load", _set("load", lambda t: t.float()), "load should be int32 or int64", 0),
    ("meta", "load", _set("load", lambda t: t.to("meta")), "all tensors must be on one device", 0),
    ("int16", "topk_ids", _set("topk_ids", lambda t: t.short()), "topk_ids should be int32", 0),
    ("uint8", "physical_ids", _set("physical_ids", lambda t: t.byte()), "got torch.uint8", 0),
    ("empty", "log2phy", _set("log2phy", lambda t: t[:, :0]), "got [3, 0]", 0),
    ("bool", "replica_count", _set("replica_count", lambda t: t.bool()), "got torch.bool", 0),
    ("int32", "offset", _set("offset", lambda t: t.int()), "offset should be int64", 0),
    ("u32", "num_valid_tokens", _set("num_valid_tokens", lambda t: t.to(torch.uint32)), "integ", 0),
    ("int64", "record_enabled", _set("record_enabled", lambda t: t.long()), "a bool tensor", 0),
]

REJECTED_PARAMS = [
    pytest.param(op, breaker, message, bool(compile_too), id=f"{op}-{arg}-{case_id}")
    for case_id, arg, breaker, message, compile_too in REJECTED
    for op, names in ARGS.items()
    if arg in names and (arg == "load" or "load" in names or not case_id.startswith("in-"))
]


@pytest.mark.parametrize(("op", "breaker", "message", "compile_too"), REJECTED_PARAMS)
def test_every_kernel_rejects_alike(op, breaker, message, compile_too, compiled_kernels):
    inputs = valid_inputs()
    breaker(inputs)
    kernels = {"reference": REFERENCE[op], "native": getattr(OPS, op), "fake": fake_kernel(op)}
    if compile_too:
        kernels["compiled"] = compiled_kernels[(op, False)]
    outcomes = {name: run_kernel(kernel, op, inputs) for name, kernel in kernels.items()}
    assert outcomes["reference"].error is not None, f"{op} accepted the input"
    assert message in outcomes["reference"].error
    assert_same_outcome(outcomes)


def test_rejection_does_not_depend_on_the_record_flag():
    """A bad load is refused also on steps that record nothing (the kernel runs every step)."""
    for make_load in (lambda: torch.zeros(1, dtype=torch.int64).expand(4), lambda: torch.zeros(0)):
        inputs = valid_inputs()
        inputs["load"] = make_load()
        inputs["record_enabled"] = torch.tensor(False)
        for op in ("record_load", "map_and_record"):
            outcomes = {
                name: run_kernel(kernel, op, inputs)
                for name, kernel in (("reference", REFERENCE[op]), ("native", getattr(OPS, op)))
            }
            assert outcomes["reference"].error is not None
            assert_same_outcome(outcomes)


# -- the defined results for table values the checks cannot see ----------------------------------


@pytest.mark.parametrize("kernel", ["native", "reference"])
@pytest.mark.parametrize("ids_dtype", [I32, I64])
def test_unusable_table_entries_map_to_replica_zero_or_minus_one(kernel, ids_dtype):
    """An entry < 0, or beyond what the output dtype holds, is no slot: fall back, else -1.

    Before, an int64 entry of 2**32 + 1 under int32 ids came out as slot 1 (the cast wrapped)
    and the reference counted it in slot 1 while the native kernel did not.
    """
    fused = OPS.map_and_record if kernel == "native" else map_and_record_ref
    big = 2**32 + 1
    log2phy = torch.tensor([[big, 1], [2, -7], [3, -9], [-5, -1], [2**31, 0], [9, -1]])
    count = torch.tensor([1, 2, 2, 2, 1, 1])
    load = torch.zeros(4, dtype=torch.int64)
    ids = torch.tensor([[0, 1, 2, 3, 4, 5]] * 4, dtype=ids_dtype)
    out = fused(ids, log2phy, count, torch.tensor(0), load, torch.tensor(4), torch.tensor(True))
    rows = out.tolist()
    narrow = ids_dtype == I32
    for row in rows:
        assert row[0] == (-1 if narrow else big)  # replica 0 itself unusable under int32 ids
        assert row[1] == 2 and row[2] == 3  # -7, -9 (count 2 picks either) fall back to replica 0
        assert row[3] == -1  # no usable entry at all
        assert row[4] == (-1 if narrow else 2**31)
        assert row[5] == 9  # a slot >= P is mapped as is, never counted
    # Only slots in [0, P) that the output names are counted, once per occurrence.
    flat = [s for row in rows for s in row]
    assert load.tolist() == [flat.count(p) for p in range(4)]


# -- the native kernel's large-call paths ---------------------------------------------------------


@pytest.mark.parametrize("huge_counts", [False, True], ids=["precomputed", "direct"])
@pytest.mark.parametrize("rows", [300, 17_000], ids=["one-thread", "threads"])
@pytest.mark.parametrize("op", list(ARGS))
def test_large_calls_agree_with_the_reference(op, rows, huge_counts):
    """Calls of 1024+ pairs take other native paths: per-expert precomputed slots (unless a count
    of 2**32 or more forces the direct lookup), a private histogram, and from 2 * 65536 pairs on
    several threads. The same hostile values must give the same answer there."""
    rng = random.Random(f"{op}-{rows}-{huge_counts}")
    inputs = random_inputs(rng, "mixed-strided", rows=4, top_k=8, experts=7, width=3, slots=30)
    generator = torch.Generator().manual_seed(rows + huge_counts)
    for name in ("topk_ids", "physical_ids"):
        # Mostly in range, with the small case's hostile values (dtype bounds included) mixed in.
        ids = torch.randint(-2, 33, (rows, 8), generator=generator, dtype=torch.int32)
        hostile = torch.randint(0, 8, (rows, 8), generator=generator) == 0
        pool = inputs[name].reshape(-1).repeat(rows * 2)[: rows * 8].reshape(rows, 8)
        inputs[name] = torch.where(hostile, pool, ids)
    inputs["num_valid_tokens"] = torch.tensor(rows - 3, dtype=torch.int16)
    inputs["record_enabled"] = torch.tensor(True)
    counts = [rng.randint(-2, 5) for _ in range(7)]
    if huge_counts:
        counts[3] = 2**32 + 5
        # An int64 counter at its limit wraps like ATen's (the int32 one of the family does too).
        inputs["load"] = torch.tensor([INT64_MAX, INT64_MAX - 1, 0] * 10, dtype=torch.int64)
    inputs["replica_count"] = torch.tensor(counts, dtype=torch.int64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outcomes = {
            "reference": run_kernel(REFERENCE[op], op, inputs),
            "native": run_kernel(getattr(OPS, op), op, inputs),
        }
    finally:
        torch.set_num_threads(threads)
    assert outcomes["reference"].error is None, outcomes["reference"].error
    assert_same_outcome(outcomes)


def test_read_only_inputs_may_be_broadcast_views():
    """Only ``load`` must own its cells: ids, table and counts may be stride-0 (expanded)."""
    inputs = valid_inputs()
    inputs["topk_ids"] = torch.tensor([[2, 0, 1]]).expand(5, 3)
    inputs["physical_ids"] = torch.tensor([3]).expand(4, 6)
    inputs["log2phy"] = torch.tensor([[1], [2], [0]]).expand(3, 4)
    inputs["replica_count"] = torch.tensor(3).expand(3)
    inputs["num_valid_tokens"] = torch.tensor(4)
    for op in ARGS:
        outcomes = {
            "reference": run_kernel(REFERENCE[op], op, inputs),
            "native": run_kernel(getattr(OPS, op), op, inputs),
        }
        assert outcomes["reference"].error is None, outcomes["reference"].error
        assert_same_outcome(outcomes)
