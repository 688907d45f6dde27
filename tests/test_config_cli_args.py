"""Command-line spellings of the EPLB options: parsing, typing and duplicates."""

from __future__ import annotations

import json
import re

import pytest

from eplb_graph import RuntimeSettings
from eplb_graph.integrations.settings import parse_cli_args, resolve_eplb_config
from tests.config_helpers import NAMES, control, legacy, raises


def test_parse_dotted_keys_with_space_and_equals():
    args, rest = parse_cli_args(
        [
            "serve",
            "model",
            "--enable-eplb",
            "--eplb-config.window_size",
            "50",
            "--eplb-config.step_interval=60",
            "--eplb-config.use_async",
            "false",
            "--eplb-config.log-balancedness=TRUE",
            "--tensor-parallel-size",
            "16",
        ]
    )
    assert args["enable_eplb"]
    assert args["eplb_config"] == {
        "window_size": 50,
        "step_interval": 60,
        "use_async": False,
        "log_balancedness": True,
    }
    assert rest == ("serve", "model", "--tensor-parallel-size", "16")


def test_parse_json_eplb_config_and_additional_config():
    args, _ = parse_cli_args(
        [
            "--enable_eplb",
            "--eplb-config",
            '{"window_size": 100, "policy": "default"}',
            "--additional-config",
            '{"eplb_config": {"load_collection_phase": "prefill"}, "other": true}',
        ]
    )
    assert args["eplb_config"] == {"window_size": 100, "policy": "default"}
    assert args["additional_config"]["eplb_config"] == {"load_collection_phase": "prefill"}
    settings = resolve_eplb_config(
        **args, num_experts=128, ep_size=16, policy_names=NAMES, environ={}
    )
    assert settings.window_size == 100
    assert settings.load_collection_phase.value == "prefill"


def test_parse_user_guide_command_line_resolves():
    command = (
        "--tensor-parallel-size 16 --enable-expert-parallel --enable-eplb "
        "--eplb-config.window_size 50 --eplb-config.step_interval 50 "
        "--eplb-config.num_redundant_experts 16 --eplb-config.use_async true "
        "--eplb-config.log_balancedness true --eplb-config.log_balancedness_interval 1"
    )
    argv = [
        *command.split(" "),
        "--additional-config",
        '{"eplb_config":{"load_collection_phase":"all"}}',
    ]
    args, rest = parse_cli_args(argv)
    assert rest == ("--tensor-parallel-size", "16", "--enable-expert-parallel")
    settings = resolve_eplb_config(
        **args, num_experts=128, ep_size=16, policy_names=NAMES, environ={}
    )
    assert control(settings) == control(
        RuntimeSettings(
            window_size=50, step_interval=50, log_balancedness=True, log_balancedness_interval=1
        )
    )
    assert settings.num_redundant_experts == 16 and settings.use_async


def test_parse_legacy_additional_config_resolves_to_legacy():
    args, _ = parse_cli_args(
        ["--additional-config", json.dumps(legacy(dynamic_eplb=True, eplb_policy_type=3))]
    )
    assert not args["enable_eplb"] and args["eplb_config"] is None
    settings = resolve_eplb_config(
        **args, num_experts=64, ep_size=4, policy_names=NAMES, environ={}
    )
    # The legacy cycle (600 collected + 50 for the policy) with the type's policy.
    assert settings.step_interval == 650 and settings.policy == "flash_lb"


def test_parse_coercion_errors_name_the_field():
    with raises("eplb_config.window_size", "expected an integer, got 'abc'"):
        parse_cli_args(["--eplb-config.window_size", "abc"])
    with raises("eplb_config.use_async", "expected true or false, got 'maybe'"):
        parse_cli_args(["--eplb-config.use_async=maybe"])
    with raises("eplb_config.window_size", "must be >= 1, got -5"):
        parse_cli_args(["--eplb-config.window_size", "-5"])
    with raises("enable_eplb", "expected true or false, got 'sure'"):
        parse_cli_args(["--enable-eplb=sure"])


def test_parse_text_none_clears_optional_field_and_enable_eplb_false():
    args, _ = parse_cli_args(["--enable-eplb=false", "--eplb-config.communicator", "none"])
    assert not args["enable_eplb"] and args["eplb_config"] == {"communicator": None}


def test_parse_unknown_or_misplaced_dotted_key():
    with raises("eplb_config.windowsize", r"did you mean 'window_size'"):
        parse_cli_args(["--eplb-config.windowsize", "5"])
    with raises("eplb_config.load_collection_phase", "--additional-config"):
        parse_cli_args(["--eplb-config.load_collection_phase", "prefill"])
    with raises("eplb_config.dynamic_eplb", "legacy additional_config key"):
        parse_cli_args(["--eplb-config", '{"dynamic_eplb": true}'])


def test_parse_json_values_are_typed_strictly():
    with raises("eplb_config.window_size", "expected an integer, got '100'"):
        parse_cli_args(["--eplb-config", '{"window_size": "100"}'])


def test_parse_same_field_twice_is_rejected():
    with raises("eplb_config.window_size", r"given twice \(--eplb-config JSON and --eplb-config"):
        parse_cli_args(["--eplb-config", '{"window_size": 5}', "--eplb-config.window_size", "6"])
    with raises("additional_config", "given twice"):
        parse_cli_args(["--additional-config", "{}", "--additional-config", "{}"])


def test_parse_malformed_json_reports_line_and_column():
    with raises("eplb_config", r"not valid JSON \(line 1, column 16: Expecting value\)"):
        parse_cli_args(["--eplb-config", '{"window_size":}'])
    with raises("eplb_config", "must be a JSON object"):
        parse_cli_args(["--eplb-config", "[1]"])
    with raises("additional_config", "not valid JSON"):
        parse_cli_args(["--additional-config={eplb_config: 1}"])


def test_parse_missing_values_and_dotted_additional_config():
    with raises("eplb_config.window_size", "needs a value"):
        parse_cli_args(["--eplb-config.window_size"])
    with raises("eplb_config.use_async", "needs a value"):
        parse_cli_args(["--eplb-config.use_async", "--enable-eplb"])
    with raises("additional_config", "needs a value"):
        parse_cli_args(["--additional-config"])
    with raises("additional_config.eplb_config", "one JSON object"):
        parse_cli_args(["--additional-config.eplb_config", "{}"])
    with raises("enable_eplb", "takes no field"):
        parse_cli_args(["--enable-eplb.window_size", "5"])


def test_parse_stops_at_double_dash():
    args, rest = parse_cli_args(["--enable-eplb", "--", "--eplb-config.window_size", "x"])
    assert args["enable_eplb"] and args["eplb_config"] is None
    assert rest == ("--", "--eplb-config.window_size", "x")


@pytest.mark.parametrize(
    "text",
    ["1_000", "\uff11\uff10\uff10\uff10", "+5", "\u0661\u0660", "0x10", "1e3", "5.0", "\u30005"],
    ids=["underscore", "full-width", "plus", "arabic-indic", "hex", "exponent", "float", "ideo"],
)
def test_parse_integer_text_is_plain_ascii_decimal(text):
    """``int()`` takes '1_000', '+5' and other scripts' digits; a setting takes only 0-9."""
    with raises("eplb_config.window_size", re.escape(f"expected an integer, got {text!r}")):
        parse_cli_args(["--eplb-config.window_size", text])


def test_parse_integer_text_neighbours_still_accepted():
    args, _ = parse_cli_args(
        ["--eplb-config.window_size", " 1000\t", "--eplb-config.step_interval=7"]
    )
    assert args["eplb_config"] == {"window_size": 1000, "step_interval": 7}
    with raises("eplb_config.window_size", "must be >= 1, got -5"):
        parse_cli_args(["--eplb-config.window_size", "-5"])
    with raises("eplb_config.window_size", "must be <= 1048576, got 1048577"):
        parse_cli_args(["--eplb-config.window_size", "1048577"])
    with raises("eplb_config.step_interval", "got '1000000000000000000000000000000'; 31 digits"):
        parse_cli_args(["--eplb-config.step_interval", str(10**30)])


def test_parse_ten_to_the_thirty_in_json_is_rejected_with_the_bound():
    with raises("eplb_config.window_size", f"must be <= 1048576, got {10**30}"):
        parse_cli_args(["--eplb-config", json.dumps({"window_size": 10**30})])
    with raises("eplb_config.step_interval", f"must be <= 2147483647, got {10**30}"):
        parse_cli_args(["--eplb-config", json.dumps({"step_interval": 10**30})])


def test_parse_duplicate_json_keys_are_rejected_naming_the_key():
    """The documented rule "a field given twice is an error" holds inside one JSON object too."""
    with raises("eplb_config.window_size", "duplicate key 'window_size' in one JSON object"):
        parse_cli_args(["--eplb-config", '{"window_size": 5, "window_size": 600}'])
    with raises(
        "additional_config.eplb_config.dynamic_eplb", "duplicate key 'dynamic_eplb'.*--additional"
    ):
        parse_cli_args(
            [
                "--additional-config",
                '{"eplb_config": {"dynamic_eplb": true, "dynamic_eplb": false}}',
            ]
        )
    with raises("additional_config.eplb_config", "duplicate key 'eplb_config'"):
        parse_cli_args(["--additional-config", '{"eplb_config": {}, "eplb_config": {}}'])
    with raises("additional_config.other[1].seed", "duplicate key 'seed'"):
        parse_cli_args(["--additional-config", '{"other": [{}, {"seed": 1, "seed": 1}]}'])


def test_parse_duplicate_neighbours_are_unchanged():
    with raises("eplb_config.window_size", r"given twice \(--eplb-config.window_size and --eplb"):
        parse_cli_args(["--eplb-config.window_size", "5", "--eplb-config", '{"window_size": 6}'])
    args, _ = parse_cli_args(
        ["--eplb-config", '{"window_size": 5}', "--eplb-config", '{"step_interval": 6}']
    )
    assert args["eplb_config"] == {"window_size": 5, "step_interval": 6}
    args, _ = parse_cli_args(["--additional-config", '{"a": {"k": 1}, "b": {"k": 1}}'])
    assert args["additional_config"] == {"a": {"k": 1}, "b": {"k": 1}}


@pytest.mark.parametrize(
    "argv",
    [
        ["--enable-eplb", "--enable-eplb=false"],
        ["--enable-eplb=false", "--enable-eplb"],
        ["--enable-eplb", "--enable_eplb"],
        ["--enable-eplb=true", "serve", "--enable-eplb=true"],
    ],
)
def test_parse_enable_eplb_given_twice_is_rejected(argv):
    with raises("enable_eplb", "given twice"):
        parse_cli_args(argv)


def test_parse_json_nesting_and_number_size_are_bounded():
    with raises("additional_config", "nested too deeply"):
        parse_cli_args(["--additional-config", '{"x": ' + "[" * 100_000])
    with raises("additional_config.other", "integer 1000.* has 5001 digits, more than the 100"):
        parse_cli_args(["--additional-config", '{"other": 1' + "0" * 5000 + "}"])
    with raises("eplb_config.window_size", "has 101 digits"):
        parse_cli_args(["--eplb-config", '{"window_size": 1' + "0" * 100 + "}"])
    # Other features' values are theirs: NaN is left to them, as a lenient parser would.
    args, _ = parse_cli_args(["--additional-config", '{"other": NaN}'])
    assert args["additional_config"]["other"] != args["additional_config"]["other"]
