"""Run a function on N ranks: spawned on this machine, or as one rank under ``torchrun``.

Spawned ranks rendezvous through a ``FileStore`` in a private temporary directory (no ports to
pick). Under ``torchrun`` the ``env://`` rendezvous is used; the serving group uses the device
backend (NCCL with CUDA, HCCL with torch_npu) and EPLB builds its own gloo groups on top.

The launcher owns its ranks for their whole life. A rank that dies or raises stops the others at
once (a peer would otherwise wait in a collective until its timeout), and SIGINT, SIGTERM or
SIGHUP to the launcher stops every rank within seconds and removes the scratch directory, instead
of leaving ranks orphaned (SIGTERM's default) or waiting for them to finish (SIGINT's default:
Python joins child processes at exit). A rank also dies with the launcher if the launcher is
killed outright (Linux), when no cleanup can run.

Spawned ranks are fresh interpreters with no logging configured, so they would drop every INFO
line a verbose launcher asked for: each rank logs at the launcher's level and format instead,
its lines prefixed with its rank (:class:`LoggingSetup`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eplb_graph.errors import EplbError

logger = logging.getLogger(__name__)

STOP_GRACE_S = 3.0  # SIGTERM, then this long, then SIGKILL: a stop never waits on a rank
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def launched_by_torchrun() -> bool:
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def serving_backend() -> str:
    """The device backend for the serving group (gloo on CPU-only machines)."""
    if torch.cuda.is_available():
        return "nccl"
    if hasattr(torch, "npu") and torch.npu.is_available():  # type: ignore[attr-defined]
        return "hccl"
    return "gloo"


def run_under_torchrun(fn: Callable, *args, backend: str | None = None, timeout_s: float = 600.0):
    """This process is one torchrun rank: init env:// and run ``fn(rank, world, *args)``.

    ``backend``: the serving group's backend; default :func:`serving_backend` (the device's).
    A job whose serving tensors live on the CPU (the demo) must pass ``"gloo"``.
    """
    dist.init_process_group(backend or serving_backend(), timeout=timedelta(seconds=timeout_s))
    try:
        return fn(dist.get_rank(), dist.get_world_size(), *args)
    finally:
        dist.destroy_process_group()


class RankFailed(EplbError, RuntimeError):
    """A spawned rank raised (or died); the message carries its traceback.

    Attributes:
        rank: the rank that failed.
        reason: one line: the exception, or how the process ended.
        details: the rank's traceback ("" when the process died without one).
    """

    def __init__(self, rank: int, reason: str, details: str = "") -> None:
        self.rank = rank
        self.reason = reason
        self.details = details
        super().__init__(f"{self.summary}\n{details}" if details else self.summary)

    @property
    def summary(self) -> str:
        """One line naming the rank and what happened to it."""
        return f"rank {self.rank} failed: {self.reason}"


class RankDied(RankFailed):
    """A spawned rank's process ended without a result: killed by a signal, or a non-zero exit.

    Attributes (besides :class:`RankFailed`'s): ``exitcode`` (the process exit status, negative
    for a signal, as ``multiprocessing`` reports it) and ``signal`` (the signal name or None).
    """

    def __init__(self, rank: int, exitcode: int | None) -> None:
        self.exitcode = exitcode
        self.signal = _signal_name(-exitcode) if exitcode is not None and exitcode < 0 else None
        if self.signal is not None:
            reason = f"killed by {self.signal}"
        elif exitcode:
            reason = f"exited with status {exitcode} before returning a result"
        else:
            reason = "ended without returning a result"
        super().__init__(rank, reason)

    @property
    def summary(self) -> str:
        return f"rank {self.rank} {self.reason}"


class RanksInterrupted(EplbError, RuntimeError):
    """SIGTERM or SIGHUP reached the launcher, every rank was stopped and the scratch removed,
    and the signal, delivered again, did not end the process (it is blocked in this thread).

    ``signum`` is the signal; ``exit_status`` is the shell convention for it, ``128 + signum``.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_status = 128 + signum
        super().__init__(f"stopped by {_signal_name(signum)}; every rank was stopped")


class RanksTimedOut(EplbError, TimeoutError):
    """The ranks did not finish in time; they were stopped."""


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _interruption(signum: int) -> BaseException:
    """What unwinds the launcher: ``KeyboardInterrupt`` for SIGINT, as Python does; for SIGTERM
    and SIGHUP a ``SystemExit``, which no ``except Exception`` on the way can swallow and which
    :func:`spawn_ranks` turns back into the signal once the ranks are stopped."""
    return KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)


def _die_by(signum: int) -> None:
    """End this process by ``signum`` as its default action would have, now that the ranks and
    the scratch are gone: its parent sees "killed by SIGTERM", not a Python error a host could
    catch and carry on from."""
    logger.warning("stopped by %s; every rank was stopped", _signal_name(signum))
    for handler in logging.getLogger().handlers:
        handler.flush()
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)
    raise RanksInterrupted(signum)  # only when the signal is blocked in this thread


class _StopOnSignals:
    """While ranks run, turn SIGINT/SIGTERM/SIGHUP into an exception in the launcher's main
    thread, so its ``finally`` stops the ranks and removes the scratch directory.

    Only default dispositions are replaced: a signal the caller ignores stays ignored (SIGINT in
    a background job), and a handler the host installed stays in charge. Once cleanup has begun
    (:meth:`shield`), further signals are held and re-raised after it, so a second Ctrl-C cannot
    leave ranks or files behind. Signal handlers exist only in the main thread; elsewhere this
    does nothing.
    """

    def __init__(self) -> None:
        self._previous: dict[int, object] = {}
        self._shielded = False
        self._pending: int | None = None
        self.stopped_by: int | None = None  # the SIGTERM/SIGHUP that unwound the launcher

    def __enter__(self) -> _StopOnSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in _STOP_SIGNALS:
            if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, _frame) -> None:
        if self._shielded:
            self._pending = self._pending or signum
            return
        self._shielded = True
        self.stopped_by = signum
        raise _interruption(signum)

    def shield(self) -> None:
        self._shielded = True

    def __exit__(self, exc_type, _exc, _tb) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self._pending is not None and exc_type is None:
            self.stopped_by = self._pending
            raise _interruption(self._pending)


def _die_with_launcher(launcher_pid: int) -> None:
    """Linux: have the kernel SIGKILL this rank when the launcher dies, even by SIGKILL."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher_pid:  # the launcher died before the request took effect
        os._exit(1)


def _start_resource_tracker() -> None:
    """Start ``multiprocessing``'s resource tracker, if this process has none, with its leak
    warning off.

    The ranks share the tracker of the process that spawns them. A rank stopped or killed by
    the launcher cannot release what it registered (torch's compile progress bar takes a
    named semaphore); the tracker unlinks it, correctly, and then prints a multi-line
    "leaked semaphore" warning after the launcher has reported the stop in one line. The
    tracker reads its warning filters from the environment when it starts, so the filter is set
    for that moment only; the ranks, started later, never see it.
    """
    from multiprocessing import resource_tracker

    quiet = "ignore:resource_tracker:UserWarning"
    previous = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = f"{previous},{quiet}" if previous else quiet
    try:
        resource_tracker.ensure_running()
    finally:
        if previous is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = previous


class LoggingSetup:
    """The launcher's root logging level and format, for its spawned ranks to log alike.

    Only a launcher that configured logging (a root handler exists, as after ``logging.
    basicConfig`` or ``eplb-graph -v``) is copied; otherwise the ranks keep Python's default
    (warnings and above, bare), as a host that left logging alone expects.
    """

    def __init__(self, level: int | None, fmt: str | None) -> None:
        self.level = level
        self.fmt = fmt

    @classmethod
    def of_this_process(cls) -> LoggingSetup:
        root = logging.getLogger()
        if not root.handlers:
            return cls(None, None)
        formatter = root.handlers[0].formatter
        fmt = formatter._fmt if formatter is not None else None
        return cls(root.level, fmt or logging.BASIC_FORMAT)

    def apply(self, rank: int) -> None:
        if self.level is None:
            return
        logging.basicConfig(level=self.level, format=f"[rank {rank}] {self.fmt}", force=True)


def _result_path(scratch: str, rank: int) -> str:
    return os.path.join(scratch, f"rank{rank}.pkl")


def _spawned(rank, world_size, init_file, fn, args, scratch, timeout_s, launcher_pid, logs):
    _die_with_launcher(launcher_pid)
    logs.apply(rank)
    # The launcher decides when ranks stop (a terminal's Ctrl-C reaches the whole process
    # group); a rank interrupted on its own would only race the launcher's cleanup.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        result = ("ok", fn(rank, world_size, *args))
    except BaseException as error:
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        result = ("error", (reason, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    partial = _result_path(scratch, rank) + ".partial"
    with open(partial, "wb") as handle:
        pickle.dump(result, handle)
    os.replace(partial, _result_path(scratch, rank))  # a rank killed mid-write leaves no result


def _collect(process, rank: int, scratch: str):
    """The result of a rank whose process has ended, or the :class:`RankFailed` to raise."""
    process.join()
    path = _result_path(scratch, rank)
    if process.exitcode != 0 or not os.path.exists(path):
        return RankDied(rank, process.exitcode)
    with open(path, "rb") as handle:
        status, value = pickle.load(handle)
    if status != "ok":
        reason, details = value
        return RankFailed(rank, reason, details)
    return value


def _wait_for_ranks(processes: list, scratch: str, deadline: float) -> list:
    """Results in rank order, or raise the first failure (a death before a raise: the death is
    usually why its peers raised)."""
    results: dict[int, object] = {}
    running = {process.sentinel: rank for rank, process in enumerate(processes)}
    while running:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RanksTimedOut(f"ranks {sorted(running.values())} did not finish in time")
        failures: list[RankFailed] = []
        for sentinel in wait(list(running), timeout=min(remaining, 1.0)):
            rank = running.pop(sentinel)
            outcome = _collect(processes[rank], rank, scratch)
            if isinstance(outcome, RankFailed):
                failures.append(outcome)
            else:
                results[rank] = outcome
        if failures:
            raise min(
                failures, key=lambda failure: (not isinstance(failure, RankDied), failure.rank)
            )
    return [results[rank] for rank in range(len(processes))]


def _stop(processes: list, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every rank still running, SIGKILL what is left after ``grace_s``; reap all."""
    alive = [p for p in processes if p.pid is not None and p.exitcode is None]
    for process in alive:
        process.terminate()
    deadline = time.monotonic() + grace_s
    for process in alive:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in alive:
        if process.exitcode is None:
            process.kill()
            process.join(grace_s)


def spawn_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 600.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; results in
    rank order. ``fn`` must be importable (module level). Call under ``__main__`` guards.

    Raises:
        RankFailed: a rank raised (:class:`RankDied`: a rank's process died); the other ranks
            were stopped.
        KeyboardInterrupt: SIGINT reached this process; every rank was stopped first.
        RanksInterrupted: only where SIGTERM or SIGHUP is blocked; otherwise, once every rank
            is stopped and the scratch removed, the signal ends this process as it would have.
        RanksTimedOut: the ranks ran past ``timeout_s + 60`` s.
    In every case no rank outlives the call and the scratch directory is removed.
    """
    context = mp.get_context("spawn")
    _start_resource_tracker()
    signals = _StopOnSignals()
    try:
        return _run_ranks(context, signals, fn, world_size, args, timeout_s)
    except SystemExit:
        if signals.stopped_by is None or signals.stopped_by == signal.SIGINT:
            raise  # the ranks' own code, or the host, asked to exit
        _die_by(signals.stopped_by)
        raise  # unreachable: _die_by never returns


def _run_ranks(
    context, signals: _StopOnSignals, fn: Callable, world_size: int, args: tuple, timeout_s: float
) -> list:
    with signals, tempfile.TemporaryDirectory(prefix="eplb-graph-") as scratch:
        init_file = os.path.join(scratch, "rendezvous")
        processes: list = []
        logs = LoggingSetup.of_this_process()
        try:
            for rank in range(world_size):
                process = context.Process(
                    target=_spawned,
                    args=(
                        rank,
                        world_size,
                        init_file,
                        fn,
                        args,
                        scratch,
                        timeout_s,
                        os.getpid(),
                        logs,
                    ),
                    name=f"eplb-graph-rank{rank}",
                )
                processes.append(process)
                process.start()
            return _wait_for_ranks(processes, scratch, time.monotonic() + timeout_s + 60)
        finally:
            signals.shield()
            _stop(processes)
