"""Legacy settings (vllm-ascend Model Runner V1 keys): every key's type, range and file rules."""

from __future__ import annotations

import os

import pytest

from eplb_graph import Placement
from eplb_graph.integrations.settings import LEGACY_POLICY_TYPES, LegacyEplbConfig
from tests.config_helpers import legacy, raises, resolve, write_map


def test_legacy_defaults_match_vllm_ascend():
    config = LegacyEplbConfig()
    assert (config.dynamic_eplb, config.expert_heat_collection_interval) == (False, 600)
    assert (config.algorithm_execution_interval, config.eplb_policy_type) == (50, 2)
    assert (config.num_redundant_experts, config.eplb_heat_collection_stage) == (0, "all")
    assert (config.expert_map_path, config.expert_map_record_path) == (None, None)
    assert (config.mode, config.enabled) == ("off", False)


@pytest.mark.parametrize(("policy_type", "name"), sorted(LEGACY_POLICY_TYPES.items()))
def test_legacy_policy_type_maps_to_registered_names(policy_type, name):
    config = resolve(additional_config=legacy(dynamic_eplb=True, eplb_policy_type=policy_type))
    assert config.policy == name


def test_legacy_policy_type_mapping_is_vllm_ascends():
    assert LEGACY_POLICY_TYPES == {1: "default", 2: "swift_balance", 3: "flash_lb"}


def test_legacy_policy_type_0_random_placement_is_not_offered_for_serving():
    """vllm-ascend's type 0 is random placement: a test policy a serving setting must not reach."""
    message = (
        r"type 0 selects random placement, a test policy not offered for serving; "
        r"accepted types: 1 \(default\), 2 \(swift_balance\), 3 \(flash_lb\)$"
    )
    with raises("additional_config.eplb_config.eplb_policy_type", message):
        resolve(additional_config=legacy(dynamic_eplb=True, eplb_policy_type=0))
    with raises("additional_config.eplb_policy_type", "a test policy not offered for serving"):
        resolve(additional_config={"dynamic_eplb": True, "eplb_policy_type": 0})
    with raises("additional_config.eplb_config.eplb_policy_type", "not offered for serving"):
        LegacyEplbConfig(eplb_policy_type=0)


def test_legacy_policy_type_range_and_type():
    with raises(
        "additional_config.eplb_config.eplb_policy_type",
        r"must be one of 1 \(default\), 2 \(swift_balance\), 3 \(flash_lb\), got 4",
    ):
        resolve(additional_config=legacy(dynamic_eplb=True, eplb_policy_type=4))
    with raises("additional_config.eplb_config.eplb_policy_type", "expected an integer, got true"):
        resolve(additional_config=legacy(dynamic_eplb=True, eplb_policy_type=True))


@pytest.mark.parametrize(
    ("key", "value", "minimum"),
    [
        ("expert_heat_collection_interval", 0, 1),
        ("algorithm_execution_interval", 0, 1),
        ("num_redundant_experts", -2, 0),
    ],
)
def test_legacy_numeric_ranges(key, value, minimum):
    with raises(f"additional_config.eplb_config.{key}", f"must be >= {minimum}, got {value}"):
        resolve(additional_config=legacy(dynamic_eplb=True, **{key: value}))


def test_legacy_types_are_checked():
    with raises("additional_config.eplb_config.dynamic_eplb", "expected true or false, got 'true'"):
        resolve(additional_config=legacy(dynamic_eplb="true"))
    with raises(
        "additional_config.eplb_config.expert_heat_collection_interval", "expected an integer"
    ):
        resolve(additional_config=legacy(dynamic_eplb=True, expert_heat_collection_interval="600"))


def test_legacy_heat_collection_stage_choices():
    with raises("additional_config.eplb_config.eplb_heat_collection_stage", "must be one of 'all'"):
        resolve(additional_config=legacy(dynamic_eplb=True, eplb_heat_collection_stage="both"))


def test_legacy_record_path_rules(tmp_path):
    field = "additional_config.eplb_config.expert_map_record_path"
    with raises(field, r"must end in \.json"):
        resolve(additional_config=legacy(expert_map_record_path=str(tmp_path / "map.txt")))
    with raises(field, "must be a non-empty path"):
        resolve(additional_config=legacy(expert_map_record_path=" "))
    with raises(field, "does not exist; create it first"):
        resolve(additional_config=legacy(expert_map_record_path=str(tmp_path / "no/map.json")))
    (tmp_path / "dir.json").mkdir()
    with raises(field, "is a directory"):
        resolve(additional_config=legacy(expert_map_record_path=str(tmp_path / "dir.json")))


def test_legacy_record_directory_must_be_writable(tmp_path, monkeypatch):
    monkeypatch.setattr("eplb_graph.integrations.settings.paths.os.access", lambda *_args: False)
    with raises("additional_config.eplb_config.expert_map_record_path", "is not writable"):
        resolve(additional_config=legacy(expert_map_record_path=str(tmp_path / "m.json")))


def test_legacy_static_map_path_rules(tmp_path, monkeypatch):
    field = "additional_config.eplb_config.expert_map_path"
    with raises(field, r"must end in \.json .*got 'map\.yaml'"):
        resolve(additional_config=legacy(expert_map_path="map.yaml"))
    with raises(field, "does not exist; record a map first or fix the path"):
        resolve(additional_config=legacy(expert_map_path=str(tmp_path / "missing.json")))
    (tmp_path / "dir.json").mkdir()
    with raises(field, "is not a regular file"):
        resolve(additional_config=legacy(expert_map_path=str(tmp_path / "dir.json")))
    path = write_map(tmp_path / "map.json", Placement.default(1, 64, 0, 4))
    monkeypatch.setattr("eplb_graph.integrations.settings.paths.os.access", lambda *_args: False)
    with raises(field, "is not readable"):
        resolve(additional_config=legacy(expert_map_path=path))


@pytest.mark.parametrize(
    ("key", "maximum"),
    [
        ("expert_heat_collection_interval", 2**20),
        ("algorithm_execution_interval", 2**31 - 1 - 2**20),
        ("num_redundant_experts", 2**16),
    ],
)
def test_legacy_every_integer_has_a_documented_maximum(key, maximum):
    assert getattr(LegacyEplbConfig(**{key: maximum}), key) == maximum
    with raises(f"additional_config.eplb_config.{key}", rf"must be <= {maximum}, got {10**30}$"):
        resolve(additional_config=legacy(dynamic_eplb=True, **{key: 10**30}))
    with raises(f"additional_config.{key}", rf"must be <= {maximum}, got {maximum + 1}$"):
        resolve(additional_config={"dynamic_eplb": True, key: maximum + 1})


def test_legacy_longest_cycle_fits_the_step_bound():
    """The rearrangement interval is collection + algorithm steps; at both maxima it is still
    within the step bound the V2 ``step_interval`` has."""
    from eplb_graph.integrations.settings.fields import MAX_STEPS, MAX_WINDOW_STEPS
    from eplb_graph.integrations.settings.runtime_settings import settings_from_legacy

    config = LegacyEplbConfig(
        dynamic_eplb=True,
        expert_heat_collection_interval=MAX_WINDOW_STEPS,
        algorithm_execution_interval=MAX_STEPS - MAX_WINDOW_STEPS,
    )
    settings = settings_from_legacy(config, None, num_experts=8, ep_size=2, num_layers=None)
    assert settings.step_interval == MAX_STEPS


def test_legacy_huge_policy_type_is_described_not_printed():
    with raises("additional_config.eplb_config.eplb_policy_type", "got an integer of 16610 bits"):
        resolve(additional_config=legacy(dynamic_eplb=True, eplb_policy_type=10**5000))


def test_legacy_static_map_file_rules_are_the_loaders(tmp_path):
    """A FIFO, a device and an oversize file are refused from their metadata (never opened)."""
    from eplb_graph.expert_map import MAX_EXPERT_MAP_BYTES

    field = "additional_config.eplb_config.expert_map_path"
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with raises(field, r"'.*fifo\.json' is a FIFO \(named pipe\), not a regular file"):
        resolve(additional_config=legacy(expert_map_path=str(fifo)))
    device = tmp_path / "zero.json"
    device.symlink_to("/dev/zero")
    with raises(field, r"is a character device \(the link resolves to /dev/zero\)"):
        resolve(additional_config=legacy(expert_map_path=str(device)))
    huge = tmp_path / "huge.json"
    with huge.open("wb") as handle:
        handle.truncate(MAX_EXPERT_MAP_BYTES + 1)
    with raises(field, f"is {MAX_EXPERT_MAP_BYTES + 1} bytes, over the {MAX_EXPERT_MAP_BYTES}"):
        resolve(additional_config=legacy(expert_map_path=str(huge)))


def test_legacy_static_map_refused_while_loading_is_a_config_error(tmp_path, monkeypatch):
    """The file checked at configuration time can change before it is loaded: the loader's own
    refusal (an OSError) still becomes a ConfigError naming the field."""
    from eplb_graph import expert_map

    path = write_map(tmp_path / "map.json", Placement.default(1, 64, 0, 4))
    monkeypatch.setattr(expert_map, "MAX_EXPERT_MAP_BYTES", 16)
    with raises("additional_config.eplb_config.expert_map_path", r"cannot read .*over the 16-byte"):
        resolve(additional_config=legacy(expert_map_path=path))
