"""Eager per-call overhead of the two ways to register a PyTorch custom op from Python.

Usage::

    python tools/bench/bench_registration.py [--quick] [--json PATH] [--threads 1 2]

The same trivial bodies are registered twice, in private namespaces so nothing clashes with
``eplb_graph``:

- ``eplb_bench_co``: ``torch.library.custom_op`` (with ``register_fake``);
- ``eplb_bench_ll``: the low-level ``torch.library.Library(ns, "DEF").define`` plus
  ``.impl(..., "CompositeExplicitAutograd")`` (with ``register_fake``), as
  ``eplb_graph/ops/registration.py`` does for ``torch.ops.eplb_graph``.

Bodies: ``clone4`` returns a clone of a 4-element tensor; ``touch4`` is declared as mutating
its 4-element argument and does nothing. Each is timed called directly (the floor), through
both registrations (``torch.ops.<ns>.<op>.default``; for custom_op also through the object it
returns), with grad mode on (the default) and under ``torch.inference_mode()``. The real
``torch.ops.eplb_graph.map_and_record`` at T=1 (native CPU kernel) is timed alongside.

Samples are interleaved across variants; numbers are per-call microseconds, median and min.
The script always exits 0: it is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from timing import measure, run_benchmark, write_report

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eplb_graph import EplbState, Placement, ops

CO = "eplb_bench_co"
LL = "eplb_bench_ll"


def clone4_body(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def touch4_body(x: torch.Tensor) -> None:
    return None


def register_custom_op():
    """``torch.library.custom_op`` registrations; returns the two op objects."""

    @torch.library.custom_op(f"{CO}::clone4", mutates_args=())
    def clone4(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @clone4.register_fake
    def _(x):
        return torch.empty_like(x)

    @torch.library.custom_op(f"{CO}::touch4", mutates_args=("x",))
    def touch4(x: torch.Tensor) -> None:
        return None

    @touch4.register_fake
    def _(x):
        return None

    return clone4, touch4


def register_low_level() -> torch.library.Library:
    """``Library.define`` + ``impl(CompositeExplicitAutograd)``; keep the returned library alive."""
    lib = torch.library.Library(LL, "DEF")
    lib.define("clone4(Tensor x) -> Tensor")
    lib.define("touch4(Tensor(a!) x) -> ()")
    lib.impl("clone4", clone4_body, "CompositeExplicitAutograd")
    lib.impl("touch4", touch4_body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{LL}::clone4", lambda x: torch.empty_like(x), lib=lib)
    torch.library.register_fake(f"{LL}::touch4", lambda x: None, lib=lib)
    return lib


def variants(co_ops) -> dict[str, Callable[[], object]]:
    co_clone, co_touch = co_ops
    x = torch.arange(4, dtype=torch.float32)
    co_clone_h = getattr(torch.ops, CO).clone4.default
    co_touch_h = getattr(torch.ops, CO).touch4.default
    ll_clone_h = getattr(torch.ops, LL).clone4.default
    ll_touch_h = getattr(torch.ops, LL).touch4.default

    state = EplbState(Placement.default(1, 256, 32, 8))
    state.set_step_inputs_(1, record=True)
    tables = state.layer(0)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    routing = torch.ops.eplb_graph.map_and_record.default
    routing_args = (
        ids,
        tables.log2phy,
        tables.replica_count,
        state.offset,
        tables.load,
        state.num_valid_tokens,
        state.record_enabled,
    )
    return {
        "clone4 direct": lambda: clone4_body(x),
        "clone4 low-level": lambda: ll_clone_h(x),
        "clone4 custom_op (torch.ops)": lambda: co_clone_h(x),
        "clone4 custom_op (object)": lambda: co_clone(x),
        "touch4 direct": lambda: touch4_body(x),
        "touch4 low-level": lambda: ll_touch_h(x),
        "touch4 custom_op (torch.ops)": lambda: co_touch_h(x),
        "touch4 custom_op (object)": lambda: co_touch(x),
        "eplb_graph.map_and_record T=1": lambda: routing(*routing_args),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter cells")
    parser.add_argument("--json", type=Path, help="write the raw results here")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)

    ops.native.ensure_loaded()
    status = ops.native.status()
    co_ops = register_custom_op()
    lib = register_low_level()
    fns = variants(co_ops)
    budget = 0.05 if args.quick else 0.25
    print(f"torch {torch.__version__}, native kernel {status.value}, cpu_count {os.cpu_count()}")

    report: dict = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "native_status": status.value,
        "quick": args.quick,
        "threads": args.threads,
        "results": {},
    }
    for threads in args.threads:
        torch.set_num_threads(threads)
        report["results"][str(threads)] = {}
        for mode in ("grad", "inference_mode"):
            context = (
                torch.inference_mode() if mode == "inference_mode" else contextlib.nullcontext()
            )
            with context:
                cells = measure(fns, budget_s=budget, sample_s=budget / 25, min_samples=5)
            report["results"][str(threads)][mode] = cells
            print(f"\n== torch threads = {threads}, {mode}: per-call us ==")
            print(f"{'variant':<32} {'median':>8} {'min':>8} {'median - direct':>16}")
            for name, cell in cells.items():
                body = name.split()[0]
                direct = cells.get(f"{body} direct")
                extra = (
                    f"{cell['median_us'] - direct['median_us']:16.2f}"
                    if direct and not name.endswith("direct")
                    else f"{'':>16}"
                )
                print(f"{name:<32} {cell['median_us']:8.2f} {cell['min_us']:8.2f} {extra}")
            for body in ("clone4", "touch4"):
                co = cells[f"{body} custom_op (torch.ops)"]["median_us"]
                ll = cells[f"{body} low-level"]["median_us"]
                print(f"{body}: custom_op - low-level = {co - ll:.2f} us ({co / ll:.1f}x)")
    del lib
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    run_benchmark(main)
