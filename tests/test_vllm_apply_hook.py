"""``wrap_apply``: the one wrapper around vLLM's CPU experts ``apply`` methods.

vLLM calls ``apply`` with 15 arguments, by keyword (the modular kernel) or by position (older
callers and tests); the hook must see every argument by name either way, refuse a call that does
not match the parameters ``compat`` checked, hand vLLM's own ``apply`` the arguments it edited,
and wrap once however often the plugin installs.
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from eplb_graph.integrations.vllm.compat import PatchTarget
from eplb_graph.integrations.vllm.expert_parallel import wrap_apply

PARAMETERS = ("self", "output", "expert_map", "topk_ids")


class FakeExperts:
    calls: ClassVar[list[dict]] = []

    def apply(self, output, expert_map, topk_ids):
        FakeExperts.calls.append({"output": output, "expert_map": expert_map, "ids": topk_ids})
        return "vllm"


@pytest.fixture
def experts():
    original = FakeExperts.__dict__["apply"]
    FakeExperts.calls = []
    yield FakeExperts()
    FakeExperts.apply = original


def _install(seen: list[dict]) -> None:
    def on_local_rows(call: dict) -> bool:
        seen.append(dict(call))
        if call["expert_map"] is None:
            call["topk_ids"] = ("edited", call["topk_ids"])
            return False
        call["output"].append("local rows")
        return True

    wrap_apply(PatchTarget(__name__, "FakeExperts.apply", PARAMETERS), on_local_rows)


def test_the_hook_sees_every_argument_by_name_positional_or_keyword(experts):
    seen: list[dict] = []
    _install(seen)
    out: list = []
    assert experts.apply(out, "map", "ids") is None
    assert experts.apply(output=out, expert_map="map", topk_ids="ids") is None
    assert experts.apply(out, topk_ids="ids", expert_map="map") is None
    assert [sorted(call) for call in seen] == [sorted(PARAMETERS)] * 3
    assert all(call["self"] is experts and call["topk_ids"] == "ids" for call in seen)
    assert out == ["local rows"] * 3
    assert FakeExperts.calls == []  # the hook wrote the output: vLLM's apply never ran


def test_a_call_the_hook_declines_reaches_vllms_apply_with_its_edits(experts):
    _install([])
    assert experts.apply([], None, "ids") == "vllm"
    assert FakeExperts.calls == [{"output": [], "expert_map": None, "ids": ("edited", "ids")}]


@pytest.mark.parametrize(
    "args, kwargs",
    [
        (([], "map"), {}),  # one missing
        (([], "map", "ids", "extra"), {}),  # one too many
        (([], "map", "ids"), {"expert_map": "again"}),  # given twice
        (([], "map"), {"topk_idz": "ids"}),  # a name vLLM's apply does not have
    ],
)
def test_a_call_that_does_not_match_the_checked_parameters_is_refused(experts, args, kwargs):
    seen: list[dict] = []
    _install(seen)
    with pytest.raises(TypeError, match=r"FakeExperts\.apply takes"):
        experts.apply(*args, **kwargs)
    assert seen == [] and FakeExperts.calls == []


def test_installing_twice_wraps_once(experts):
    seen: list[dict] = []
    _install(seen)
    _install(seen)
    experts.apply([], "map", "ids")
    assert len(seen) == 1
    assert not hasattr(FakeExperts.apply.__wrapped__, "__wrapped__")
