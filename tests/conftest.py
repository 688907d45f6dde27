"""Shared test setup: make the repository root importable without an editable install."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# The suite exercises the fused native CPU kernel: build it (once, cached) or fail loudly rather
# than silently testing only the reference. Set EPLB_GRAPH_NATIVE=auto to allow the fallback.
import os  # noqa: E402

os.environ.setdefault("EPLB_GRAPH_NATIVE", "require")

import signal  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402

_WATCHED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@pytest.fixture(autouse=True)
def _signal_dispositions_are_left_as_found(request):
    """A test that leaves SIGINT ignored in pytest makes every later child process inherit it
    (a signalled demo then never stops): restore what a test changed, and name the test in a
    warning (the fresh-clone runs saw such a leak from a test not yet identified)."""
    before = {signum: signal.getsignal(signum) for signum in _WATCHED_SIGNALS}
    yield
    changed = []
    for signum, handler in before.items():
        now = signal.getsignal(signum)
        if now is not handler:
            changed.append(f"{signal.Signals(signum).name}: {handler!r} -> {now!r}")
            signal.signal(signum, handler)
    if changed:
        warnings.warn(
            f"{request.node.nodeid} left signal dispositions changed (restored): {changed}",
            pytest.PytestWarning,
            stacklevel=1,
        )
