"""pytest plugin: graph-capture regression fixtures for a downstream model runner's own suite.

Installed with the package and auto-loaded through the ``pytest11`` entry point ``eplb_graph``
(disable with ``-p no:eplb_graph``). Fixtures:

- ``eplb_graph_mode``: parametrizes a test over graph modes (``compile:eager``,
  ``compile:aot_eager``, ``compile:inductor``, ``cuda_graph``, ``npu_graph``); a mode whose
  backend is absent here is *skipped with the reason*, never silently dropped. Narrow the set with
  ``--eplb-graph-modes=compile:eager,cuda_graph``, the ``eplb_graph_modes`` ini option, or
  ``@pytest.mark.eplb_graph_modes("cuda_graph", "npu_graph")`` on a test.
- ``eplb_graph_device``: the device to build the model and state on for that mode.
- ``eplb_replay``: ``capture_commit_replay`` bound to the test's ``eplb_graph_mode``.
- ``eplb_audit``: ``assert_graph_safe`` with paths shown relative to the pytest root.

A mode the kit does not know (``--eplb-graph-modes=inductr``, the same in the ini option) is a
usage error (exit code 4) naming the valid modes; a marker naming one fails that test's
collection the same way.

Torch's structured trace (the ``torch.__trace`` logger) is kept out of pytest's log capture: the
logger does not propagate, so pytest attaches its handlers to it directly, and every compile
then leaves hundreds of records with an empty message under a failing test. Only pytest's
handlers drop them; ``TORCH_TRACE`` (tlparse) and the user's own loggers are untouched.

Importing this module is cheap (no torch import) because pytest loads it in every session of an
environment where the package is installed.
"""

from __future__ import annotations

import functools
import logging

import pytest

_ALL_MODES = ("compile:eager", "compile:aot_eager", "compile:inductor", "cuda_graph", "npu_graph")
_MARKER = "eplb_graph_modes"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("eplb_graph", "eplb-graph capture regression kit")
    group.addoption(
        "--eplb-graph-modes",
        default=None,
        metavar="MODES",
        help="comma-separated graph modes for the eplb_graph_mode fixture "
        f"(default: all of {', '.join(_ALL_MODES)}; absent backends are skipped)",
    )
    parser.addini(
        "eplb_graph_modes",
        "comma-separated graph modes for the eplb_graph_mode fixture",
        default="",
    )


#: Torch's structured-trace logger: records for tlparse, with an empty message.
_TORCH_TRACE_LOGGER = "torch.__trace"
#: The handlers pytest's logging plugin attaches to every logger (report, caplog, file, live).
_PYTEST_LOG_HANDLERS = ("report_handler", "caplog_handler", "log_file_handler", "log_cli_handler")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(*modes): run this test's eplb_graph_mode fixture only for these modes",
    )
    modes = _configured_modes(config)
    if modes:
        _check_modes(modes, "--eplb-graph-modes" if _option(config) else "ini eplb_graph_modes")


class _WithoutTorchTrace(logging.Filter):
    """Drops torch's structured-trace records (empty messages meant for tlparse)."""

    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        return not (name == _TORCH_TRACE_LOGGER or name.startswith(_TORCH_TRACE_LOGGER + "."))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Filter pytest's own log handlers (they exist once every plugin is configured)."""
    logging_plugin = session.config.pluginmanager.get_plugin("logging-plugin")
    for attribute in _PYTEST_LOG_HANDLERS:
        handler = getattr(logging_plugin, attribute, None)
        if isinstance(handler, logging.Handler) and not any(
            isinstance(existing, _WithoutTorchTrace) for existing in handler.filters
        ):
            handler.addFilter(_WithoutTorchTrace())


def _check_modes(modes: list[str], source: str) -> None:
    """Raise ``pytest.UsageError`` naming the first mode the kit does not know."""
    from eplb_graph.testing import UnknownGraphModeError, check_graph_mode

    for mode in modes:
        try:
            check_graph_mode(mode)
        except UnknownGraphModeError as error:
            raise pytest.UsageError(f"{source}: {error}") from None


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _option(config: pytest.Config) -> list[str]:
    return _split(config.getoption("--eplb-graph-modes") or "")


def _configured_modes(config: pytest.Config) -> list[str]:
    """The session's modes from the command line, else the ini; empty when neither is set."""
    return _option(config) or _split(config.getini("eplb_graph_modes") or "")


def selected_modes(config: pytest.Config, marker: pytest.Mark | None = None) -> list[str]:
    """Modes for one test: the marker wins, then the command line, then the ini, then all."""
    if marker is not None and marker.args:
        return list(marker.args)
    return _configured_modes(config) or list(_ALL_MODES)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "eplb_graph_mode" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker(_MARKER)
    modes = selected_modes(metafunc.config, marker)
    if marker is not None and marker.args:
        _check_modes(modes, f"@pytest.mark.{_MARKER} on {metafunc.definition.nodeid}")
    metafunc.parametrize("eplb_graph_mode", modes, indirect=True, ids=modes)


@pytest.fixture
def eplb_graph_mode(request: pytest.FixtureRequest) -> str:
    """One graph mode per test instance; skips, with the reason, where it cannot run here."""
    from eplb_graph.testing import graph_mode_skip_reason

    mode = getattr(request, "param", "auto")
    try:
        reason = graph_mode_skip_reason(mode)
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    if reason is not None:
        pytest.skip(f"{mode}: {reason}")
    return mode


@pytest.fixture
def eplb_graph_device(eplb_graph_mode: str):
    """Device string for this test's mode (``"cuda"`` for CUDA graphs, ``"npu"`` for NPU)."""
    from eplb_graph.testing import graph_mode_device

    return graph_mode_device(eplb_graph_mode)


@pytest.fixture
def eplb_replay(eplb_graph_mode: str):
    """``capture_commit_replay(fn, args, state, placements=None, **kw)`` in this test's mode."""
    from eplb_graph.testing import capture_commit_replay

    return functools.partial(capture_commit_replay, mode=eplb_graph_mode)


@pytest.fixture
def eplb_audit(request: pytest.FixtureRequest):
    """``assert_graph_safe(fn, args, eplb_state=None, **kw)`` reporting repo-relative paths."""
    from eplb_graph.testing import assert_graph_safe

    return functools.partial(assert_graph_safe, root=str(request.config.rootpath))
