"""Rank files left ``closed: false`` by workers vLLM killed are marked closed by the process
that stopped them (``eplb_graph/integrations/vllm/closing.py``), and only those.

The last test runs vLLM's own engine-process shutdown (``vllm.v1.utils.shutdown``, the function
the plugin wraps) on a real process that ignores SIGTERM, as a busy worker does: vLLM SIGKILLs
it, and the wrapper marks its file. Real server stops are in ``tests/test_vllm_server.py``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from eplb_graph.integrations.vllm import closing
from eplb_graph.integrations.vllm.metrics import rank_file, write_atomically


def _ended_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _write(directory, rank: int, **fields) -> None:
    write_atomically(rank_file(directory, rank), {"rank": rank, "steps": 40 + rank, **fields})


def _read(directory, rank: int) -> dict:
    return json.loads(rank_file(directory, rank).read_text())


def test_only_open_files_of_ended_writers_are_marked(tmp_path, caplog):
    ended = _ended_pid()
    _write(tmp_path, 0, closed=False, pid=ended)
    _write(tmp_path, 1, closed=False, pid=os.getpid())  # alive: its writer's to close
    _write(tmp_path, 2, closed=True, closed_by="worker", pid=ended)
    _write(tmp_path, 3, closed=False)  # no pid: written by an older plugin, left alone
    started = time.monotonic()
    caplog.set_level("INFO", logger="eplb_graph")
    marked = closing.mark_closed({str(tmp_path)}, wait_s=0.3)
    assert time.monotonic() - started < 5
    assert marked == [rank_file(tmp_path, 0)]
    assert _read(tmp_path, 0) == {
        "rank": 0,
        "steps": 40,
        "closed": True,
        "closed_by": "server",
        "pid": ended,
    }
    assert _read(tmp_path, 1)["closed"] is False
    assert _read(tmp_path, 2)["closed_by"] == "worker"
    assert _read(tmp_path, 3)["closed"] is False
    assert "1 worker(s) before they wrote their final metrics" in caplog.text
    assert str(rank_file(tmp_path, 0)) in caplog.text


def test_a_missing_or_unreadable_directory_marks_nothing(tmp_path):
    (tmp_path / "rank0.json").write_text("{half a docu")
    assert closing.mark_closed({str(tmp_path), str(tmp_path / "gone")}, wait_s=0) == []


def _stubborn_worker(directory: str) -> None:
    """Like a worker busy in a step: SIGTERM does not stop it; its file says closed: false."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    write_atomically(rank_file(directory, 0), {"rank": 0, "closed": False, "pid": os.getpid()})
    time.sleep(120)


def test_vllms_shutdown_kills_a_stubborn_worker_and_its_file_is_marked(tmp_path, monkeypatch):
    pytest.importorskip("vllm", reason="the vllm extra is not installed: pip install -e '.[vllm]'")
    from vllm.v1.utils import shutdown

    from eplb_graph.integrations.vllm import compat

    assert compat.ENGINE_PROCS_SHUTDOWN.problem() is None
    monkeypatch.setattr(closing, "_DIRECTORIES", {str(tmp_path)})
    process = multiprocessing.get_context("fork").Process(
        target=_stubborn_worker, args=(str(tmp_path),)
    )
    process.start()
    deadline = time.monotonic() + 30
    while not rank_file(tmp_path, 0).exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    closing.marking_closed_after(shutdown)([process], timeout=0.5)
    assert process.exitcode == -signal.SIGKILL
    assert _read(tmp_path, 0)["closed"] is True
    assert _read(tmp_path, 0)["closed_by"] == "server"
