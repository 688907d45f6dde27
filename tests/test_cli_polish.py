"""What a newcomer meets first at the ``eplb-graph`` command line: ``--version``, and a
``--help`` on every command that says what each option does, its default and its choices."""

from __future__ import annotations

import argparse
import re

import pytest

from eplb_graph import cli
from eplb_graph.policy import policy_names


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """``(path, parser)`` for the top level and every subcommand, nested ones included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield from _commands(subparser, (*path, name))


COMMANDS = dict(_commands(cli.build_parser()))


def test_every_command_is_walked():
    names = {" ".join(path) for path in COMMANDS}
    assert {"", "info", "map", "map validate", "audit", "simulate", "demo"} <= names


def _help_of(path: tuple[str, ...], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.main([*path, "--help"])
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps: compare unwrapped


def _compact(text: str) -> str:
    """``text`` without whitespace: argparse may wrap a line at a hyphen ("--step- interval")."""
    return re.sub(r"\s+", "", text)


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda path: " ".join(path) or "top")
def test_help_shows_text_default_and_choices_of_every_option(path, capsys):
    parser = COMMANDS[path]
    shown = _help_of(path, capsys)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        name = action.option_strings[-1] if action.option_strings else action.metavar
        assert action.help and action.help.strip(), f"{' '.join(path)} {name}: no help text"
        assert _compact(action.help) in _compact(shown), f"{name}: help text not shown"
        default = action.default
        if default not in (None, False, argparse.SUPPRESS) and action.option_strings:
            assert f"(default: {default})" in shown, f"{' '.join(path)} {name}: default not shown"
        if action.choices is not None:
            assert "{" + ",".join(action.choices) + "}" in shown, f"{name}: choices not shown"


@pytest.mark.parametrize("command", ["simulate", "demo"])
def test_policy_choices_are_the_registered_policies(command, capsys):
    shown = _help_of((command,), capsys)
    assert "--policy {" + ",".join(policy_names()) + "}" in shown


@pytest.mark.parametrize(
    ("command", "option", "choices"),
    [
        ("demo", "--format", "{unquantized,w8a8}"),
        ("demo", "--backend", "{inductor,aot_eager,eager}"),
        ("simulate", "--load-collection-phase", "{all,prefill,decode}"),
        ("simulate", "--shape", "{zipf,lognormal}"),
    ],
)
def test_enumerated_options_list_their_choices(command, option, choices, capsys):
    assert f"{option} {choices}" in _help_of((command,), capsys)


def test_version_prints_the_package_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"eplb-graph \d+\.\d+\.\d+\S*\n", out), out
    assert out == f"eplb-graph {cli.package_version()}\n"
