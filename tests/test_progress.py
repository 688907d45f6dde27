"""The CLI progress display: a bar on a terminal, a line per tenth elsewhere, 100% at the end."""

from __future__ import annotations

import io

import pytest

from eplb_graph.progress import ProgressBar, announce


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_one_line_per_tenth_and_a_final_line():
    stream = io.StringIO()
    with ProgressBar(200, "demo", stream=stream) as bar:
        for _ in range(200):
            bar.update(1, suffix="x 0.5")
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert len(lines) == 10, lines
    assert all(line.startswith("demo: ") for line in lines)
    assert lines[0].startswith("demo: 10.0% 20/200")
    assert "100.0% 200/200" in lines[-1] and lines[-1].endswith("x 0.5")


def test_a_run_that_ends_normally_ends_at_100_percent():
    """The last update may come one step short of the total (a final step not counted)."""
    for stream in (io.StringIO(), Terminal()):
        with ProgressBar(1000, "simulate", stream=stream) as bar:
            bar.update(998)
        assert "100.0% 1000/1000" in stream.getvalue().splitlines()[-1].split("\r")[-1]


def test_a_failed_run_does_not_claim_100_percent():
    stream = io.StringIO()
    with pytest.raises(RuntimeError), ProgressBar(10, "demo", stream=stream) as bar:
        bar.update(3)
        raise RuntimeError("boom")
    assert "100.0%" not in stream.getvalue()


def test_disabled_writes_nothing():
    stream = io.StringIO()
    with ProgressBar(10, "demo", enabled=False, stream=stream) as bar:
        bar.update(10)
    announce("warming up", enabled=False, stream=stream)
    assert stream.getvalue() == ""


def test_a_terminal_gets_a_bar_redrawn_in_place():
    stream = Terminal()
    with ProgressBar(10, "demo", stream=stream) as bar:
        bar.update(5)
    assert stream.getvalue().startswith("\rdemo [###")
    assert stream.getvalue().endswith("\n")
