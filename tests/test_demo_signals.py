"""Signals and dead ranks in a real ``eplb-graph demo``: nothing outlives the command.

SIGTERM (what ``timeout`` sends) or SIGINT to the parent stops every rank within seconds and
removes the launcher's scratch directory; a rank killed mid-run is reported in one line naming
the rank and the signal, and the other ranks are stopped.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Small enough to start quickly, long enough never to finish on its own during a test.
ENDLESS_DEMO = [
    "demo",
    "--steps", "100000",
    "--ranks", "2",
    "--experts", "8",
    "--redundant", "4",
    "--layers", "2",
    "--no-plot",
    "--no-progress",
]  # fmt: skip
STOP_WITHIN_S = 15.0  # "a few seconds", with room for a loaded CI machine


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in text.split()]


def _is_rank(pid: int) -> bool:
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _alive(pid: int) -> bool:
    """Running (a zombie, already dead and waiting to be reaped, does not count)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class RunningDemo:
    """An ``eplb-graph demo`` in its own process, with a private TMPDIR to watch."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmpdir = tmp_path / "tmp"
        self.tmpdir.mkdir()
        self.ranks: list[int] = []
        env = dict(
            os.environ,
            PYTHONPATH=str(ROOT),
            TMPDIR=str(self.tmpdir),
            # The compile cache stays where it is shared between runs (a private TMPDIR would
            # otherwise move it there and recompile every kernel).
            TORCHINDUCTOR_CACHE_DIR=os.environ.get(
                "TORCHINDUCTOR_CACHE_DIR",
                str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"),
            ),
        )
        self.process = subprocess.Popen(
            [sys.executable, "-m", "eplb_graph.cli", *ENDLESS_DEMO],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            # A foreground command in a terminal has SIGINT at its default. An ignored SIGINT is
            # inherited across exec, and the demo rightly keeps an ignored SIGINT ignored (a
            # background job), so a test runner that ignores it must not pass that on.
            preexec_fn=_default_sigint,
        )

    def scratch_dirs(self) -> list[Path]:
        return sorted(self.tmpdir.glob("eplb-graph-*"))

    def wait_until_serving(self, timeout_s: float = 240.0) -> list[int]:
        """The rank PIDs, once both ranks have rendezvoused and run for a moment."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.communicate()
            ranks = [pid for pid in _children(self.process.pid) if _is_rank(pid)]
            scratch = self.scratch_dirs()
            if len(ranks) == 2 and scratch and (scratch[0] / "rendezvous").exists():
                self.ranks = ranks
                time.sleep(3.0)  # into the serving loop (or compiling: any moment must work)
                return ranks
            time.sleep(0.2)
        self.process.kill()
        pytest.fail(f"the demo did not start its ranks within {timeout_s} s")

    def stop_result(self) -> tuple[int, str, float]:
        """``(exit status, stderr, seconds until the parent exited)``."""
        start = time.monotonic()
        try:
            self.process.wait(timeout=STOP_WITHIN_S * 4)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        elapsed = time.monotonic() - start
        _, err = self.process.communicate(timeout=30)
        return self.process.returncode, err, elapsed

    def kill_everything(self) -> None:
        for pid in [self.process.pid, *_children(self.process.pid), *self.ranks]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def demo(tmp_path):
    running = RunningDemo(tmp_path)
    yield running
    running.kill_everything()  # only if a test failed half-way


def _assert_no_rank_left(ranks: list[int]) -> None:
    deadline = time.monotonic() + 5.0
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in ranks if _alive(pid)], "ranks outlived the demo"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("signum", "status", "name"),
    # SIGTERM ends the parent by SIGTERM itself once the ranks are stopped (a shell shows 143);
    # SIGINT is Python's KeyboardInterrupt, which the command turns into status 130.
    [(signal.SIGTERM, -signal.SIGTERM, "SIGTERM"), (signal.SIGINT, 130, "SIGINT")],
)
def test_a_signal_to_the_parent_stops_every_rank_and_removes_the_scratch(
    demo, signum, status, name
):
    ranks = demo.wait_until_serving()
    demo.process.send_signal(signum)
    code, err, elapsed = demo.stop_result()
    assert elapsed < STOP_WITHIN_S
    assert code == status, err
    assert err.count("\n") == 1 and name in err and "Traceback" not in err, err
    _assert_no_rank_left(ranks)
    assert demo.scratch_dirs() == []


@pytest.mark.multiprocess
def test_a_rank_killed_mid_run_is_reported_in_one_line_and_its_peers_are_stopped(demo):
    ranks = demo.wait_until_serving()
    os.kill(ranks[1], signal.SIGKILL)
    code, err, elapsed = demo.stop_result()
    assert elapsed < STOP_WITHIN_S
    assert code == 1, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "rank 1" in err and "SIGKILL" in err, err
    _assert_no_rank_left(ranks)
    assert demo.scratch_dirs() == []


@pytest.mark.multiprocess
def test_a_dead_rank_raises_a_typed_error_naming_it():
    from eplb_graph.launch import RankDied, RankFailed, spawn_ranks

    with pytest.raises(RankDied) as caught:
        spawn_ranks(_die_on_rank_one, 2, timeout_s=60)
    assert isinstance(caught.value, RankFailed)
    assert (caught.value.rank, caught.value.exitcode, caught.value.signal) == (1, 7, None)
    assert caught.value.summary == "rank 1 exited with status 7 before returning a result"


def _die_on_rank_one(rank: int, _world_size: int) -> None:
    if rank == 1:
        os._exit(7)
    time.sleep(600)  # the launcher must stop this rank, not wait for it


@pytest.mark.multiprocess
def test_a_raising_rank_is_named_with_its_exception_and_traceback():
    from eplb_graph.launch import RankFailed, spawn_ranks

    with pytest.raises(RankFailed) as caught:
        spawn_ranks(_raise_on_rank_zero, 2, timeout_s=60)
    assert caught.value.summary == "rank 0 failed: ValueError: bad input on rank 0"
    assert "Traceback" in caught.value.details and "_raise_on_rank_zero" in str(caught.value)


def _raise_on_rank_zero(rank: int, _world_size: int) -> None:
    if rank == 0:
        raise ValueError("bad input on rank 0")
    time.sleep(600)
