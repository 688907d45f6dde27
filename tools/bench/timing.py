"""Interleaved micro-benchmark timing shared by the benchmarks in this folder.

Every variant is sampled in turn (not one after the other), so a burst of load from another job
on this shared machine hits all variants alike and the ratios within one run stay meaningful.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path


def calibrate(fn: Callable[[], object], sample_s: float) -> int:
    """Calls per sample so that one sample takes about ``sample_s`` seconds."""
    fn()
    calls = 1
    while True:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= sample_s / 4 or calls >= 1 << 16:
            return max(1, int(calls * sample_s / max(elapsed, 1e-9)))
        calls *= 4


def measure(
    fns: dict[str, Callable[[], object]], budget_s: float, sample_s: float, min_samples: int
) -> dict[str, dict[str, float]]:
    """Interleave samples of every variant until each has used about ``budget_s`` seconds."""
    calls = {name: calibrate(fn, sample_s) for name, fn in fns.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    spent = dict.fromkeys(fns, 0.0)
    clock = time.perf_counter
    while any(spent[n] < budget_s or len(samples[n]) < min_samples for n in fns):
        for name, fn in fns.items():
            if spent[name] >= budget_s and len(samples[name]) >= min_samples:
                continue
            n = calls[name]
            start = clock()
            for _ in range(n):
                fn()
            elapsed = clock() - start
            spent[name] += elapsed
            samples[name].append(elapsed / n * 1e6)
    return {
        name: {
            "min_us": min(values),
            "median_us": statistics.median(values),
            "samples": len(values),
            "calls_per_sample": calls[name],
        }
        for name, values in samples.items()
    }


def write_report(path: Path | None, report: dict) -> None:
    """Write the ``--json`` report (parent folders created)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {path}")


def run_benchmark(main: Callable[[], object]) -> None:
    """Entry point: a benchmark reports what it could; it never fails its caller."""
    try:
        main()
    except Exception:
        traceback.print_exc()
    sys.exit(0)
