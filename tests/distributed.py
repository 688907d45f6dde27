"""Spawn real ``torch.distributed`` gloo process groups on this machine for multi-rank tests.

Each rank runs ``fn(rank, world_size, *args)`` in a fresh process (spawn: no inherited state),
inside an initialized default gloo group. Return values come back in rank order; any rank's
exception fails the test with that rank's traceback. A per-call timeout turns a hang into a
failure instead of a stuck suite.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch.multiprocessing as mp


def _entry(rank, world_size, init_file, fn, args, result_dir, timeout_s):
    import torch.distributed as dist

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
    except BaseException:  # report every failure, including assertion errors, to the parent
        result = ("error", traceback.format_exc())
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
    with open(path, "wb") as handle:
        pickle.dump(result, handle)


def run_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 120.0) -> list:
    """Run ``fn`` on ``world_size`` spawned gloo ranks; returns each rank's result in order."""
    with tempfile.TemporaryDirectory() as scratch:
        init_file = os.path.join(scratch, "init")
        context = mp.start_processes(
            _entry,
            args=(world_size, init_file, fn, args, scratch, timeout_s),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline_ok = True
        import time

        deadline = time.monotonic() + timeout_s + 60
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                deadline_ok = False
                for process in context.processes:
                    process.kill()
                break
        if not deadline_ok:
            raise TimeoutError(f"ranks did not finish within {timeout_s + 60:.0f} s")
        results = []
        for rank in range(world_size):
            with open(os.path.join(scratch, f"rank{rank}.pkl"), "rb") as handle:
                status, value = pickle.load(handle)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
