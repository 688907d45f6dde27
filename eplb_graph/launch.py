"""Run a function on N ranks: spawned on this machine, or as one rank under ``torchrun``.

Spawned ranks rendezvous through a ``FileStore`` in a private temporary directory (no ports to
pick). Under ``torchrun`` the ``env://`` rendezvous is used; the serving group uses the device
backend (NCCL with CUDA, HCCL with torch_npu) and EPLB builds its own gloo groups on top.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from eplb_graph.errors import EplbError


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


def _spawned(rank, world_size, init_file, fn, args, result_dir, timeout_s):
    path = os.path.join(result_dir, f"rank{rank}.pkl")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(path, "wb") as handle:
        pickle.dump(result, handle)


class RankFailed(EplbError, RuntimeError):
    """A spawned rank raised; the message carries its traceback."""


def spawn_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 600.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; results in
    rank order. ``fn`` must be importable (module level). Call under ``__main__`` guards."""
    with tempfile.TemporaryDirectory(prefix="eplb-graph-") as scratch:
        init_file = os.path.join(scratch, "rendezvous")
        context = mp.start_processes(
            _spawned,
            args=(world_size, init_file, fn, args, scratch, timeout_s),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s + 60
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"ranks did not finish within {timeout_s + 60:.0f} s")
        results = []
        for rank in range(world_size):
            with open(os.path.join(scratch, f"rank{rank}.pkl"), "rb") as handle:
                status, value = pickle.load(handle)
            if status != "ok":
                raise RankFailed(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
