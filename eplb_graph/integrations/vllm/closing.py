"""Mark a rank's metrics file closed when vLLM killed its worker before the worker could.

vLLM stops an engine from the process that started it (the API server, or the script that
built ``LLM``): its process manager (``vllm.v1.utils.shutdown``) sends SIGTERM to the engine
core and, once its timeout is spent (0 s for the server by default), SIGKILLs the engine core
and every worker under it. A worker writes its final file first thing in its own shutdown
(``VllmEplbAdapter.close``), but a worker killed before it got there leaves ``closed: false``
and the process that owns the engine is the only one still alive to say so.

So in that process, right after the process manager returns, every rank file of the metrics
directories configured there that still says ``closed: false`` and whose writer (``pid``) is
gone is rewritten with ``closed: true`` and ``closed_by: "server"``. Its counts are the worker's
last write: at most ``REFRESH_S`` behind serving, exact when serving had stopped by then. A file
whose writer is still alive (another engine's, or a worker still shutting down after the wait)
is left to its writer.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from pathlib import Path

from eplb_graph.integrations.vllm import compat
from eplb_graph.integrations.vllm.logs import log_through_vllm
from eplb_graph.integrations.vllm.metrics import write_atomically

logger = logging.getLogger(__name__)

WAIT_S = 2.0
"""Longest the owning process waits, in all, for killed workers to be gone before marking."""

_DIRECTORIES: set[str] = set()


def watch(directory: str) -> None:
    """Mark ``directory``'s files closed after this process stops its engines."""
    _DIRECTORIES.add(str(Path(directory).resolve()))


def writer_gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie, not yet reaped, counts as ended)."""
    import psutil  # a dependency of vLLM

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def mark_closed(directories: set[str] | None = None, wait_s: float = WAIT_S) -> list[Path]:
    """Close the files of ended writers (see the module docstring); the files rewritten."""
    deadline = time.monotonic() + wait_s
    marked = []
    for directory in sorted(_DIRECTORIES if directories is None else directories):
        for path in sorted(Path(directory).glob("rank*.json")):
            try:
                document = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            pid = document.get("pid")
            if document.get("closed") is not False or not isinstance(pid, int):
                continue
            while not writer_gone(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not writer_gone(pid):
                continue
            try:
                write_atomically(path, {**document, "closed": True, "closed_by": "server"})
            except OSError as error:
                logger.warning("eplb-graph: cannot mark %s closed: %s", path, error)
                continue
            marked.append(path)
    if marked:
        log_through_vllm()  # the API server configured vLLM's logging after loading plugins
        logger.info(
            "eplb-graph: vLLM stopped %d worker(s) before they wrote their final metrics; "
            "their last figures are marked closed: %s",
            len(marked),
            ", ".join(str(p) for p in marked),
        )
    return marked


def install() -> None:
    """Wrap vLLM's engine-process shutdown: mark files closed after it returns."""
    owner, name, shutdown = compat.ENGINE_PROCS_SHUTDOWN.owner_and_value()
    setattr(owner, name, marking_closed_after(shutdown))


def marking_closed_after(shutdown):
    """``shutdown(procs, timeout)``, then :func:`mark_closed` (never failing the shutdown)."""

    @functools.wraps(shutdown)
    def shutdown_then_mark_closed(procs, timeout=None):
        try:
            return shutdown(procs, timeout)
        finally:
            if _DIRECTORIES:
                try:
                    mark_closed()
                except Exception as error:  # monitoring must never break vLLM's shutdown
                    logger.warning("eplb-graph: metrics files not marked closed: %s", error)

    return shutdown_then_mark_closed
