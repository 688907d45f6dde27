"""One command that checks eplb-graph on whatever CUDA device it finds.

Usage::

    PYTHONUNBUFFERED=1 PYTHONPATH=. python tools/device_check.py --json PATH [--quick]

What runs (``tools/device_checks/``), each a section of the JSON report and a row of the table:

- ``suite``: the test suite's CUDA tests (``pytest -m cuda -rs``), counts and skip reasons;
- ``raw_cuda_graph``: a MoE layer (router, ``map_and_record``, ``local_experts`` on physical
  slots) captured once with ``torch.cuda.CUDAGraph`` and replayed across 6 in-place commits
  (slot weights moved at each): every replay equals eager bit for bit, addresses stay, replays
  never sync the host;
- ``compile_inductor`` / ``compile_reduce_overhead``: the same layer under
  ``torch.compile(fullgraph=True)`` (Triton) and ``mode="reduce-overhead"`` (CUDA graph trees):
  0 graph breaks, 0 recompiles across the commits, outputs equal to eager;
- ``load_in_graph``: load counted by N replays equals N eager calls' counts, padding excluded;
- ``host_syncs``: the op and the layer, eager and compiled, under
  ``torch.cuda.set_sync_debug_mode("error")``;
- ``speed``: ``map_and_record`` against the floor and the upstream-style composite, T = 1 ...
  32768, eager and inside a captured graph, timed with CUDA events.

Without CUDA it says so and runs its CPU half as a dry run (the compile and speed checks on the
CPU, the suite's CUDA tests skipping with their reason), so CI keeps the script from rotting; the
CUDA-only sections report ``ok: null``. Exit status: 1 if any section that ran failed, else 0.
The JSON report is rewritten after every section, so a run cut short keeps what it finished.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("EPLB_GRAPH_NATIVE", "auto")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from device_checks import graphs, speed, suite
from device_checks.layer import LayerShape

SUITE_TIMEOUT_S = 240


def _environment(device: torch.device) -> dict:
    info = {
        "device": device.type,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            cuda=torch.version.cuda,
            multiprocessors=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            triton=_version_of("triton"),
        )
    return info


def _version_of(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


def _sections(device: torch.device, quick: bool) -> list[tuple[str, Callable[[], dict]]]:
    shape = LayerShape()
    on_cuda = device.type == "cuda"
    sections = [
        ("raw_cuda_graph", lambda: graphs.raw_cuda_graph(device, shape)),
        ("load_in_graph", lambda: graphs.load_in_graph(device, shape)),
        ("host_syncs", lambda: graphs.host_syncs(device, shape)),
        ("compile_inductor", lambda: graphs.compiled(device, shape, None)),
    ]
    if on_cuda:  # on a CPU, reduce-overhead is inductor again (graph trees need CUDA)
        sections.append(
            ("compile_reduce_overhead", lambda: graphs.compiled(device, shape, "reduce-overhead"))
        )
    sections.append(("speed", lambda: speed.speed_table(device, quick=quick)))
    if on_cuda or not quick:
        sections.append(("suite", lambda: suite.run_cuda_tests(SUITE_TIMEOUT_S)))
    return sections


def _run_section(name: str, body: Callable[[], dict]) -> dict:
    started = time.perf_counter()
    try:
        result = body()
    except Exception as error:  # a crash is a failed check, reported with its trace
        result = {"ok": False, "error": f"{type(error).__name__}: {error}",
                  "trace": traceback.format_exc()[-3000:]}  # fmt: skip
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def _summary(name: str, result: dict) -> str:
    """One table cell: the figures a reader checks first."""
    if result.get("ok") is None and not result.get("dry_run"):
        return f"n/a ({result.get('why', '')})"
    if result.get("dry_run"):
        return "dry run: " + _figures(name, {**result, "dry_run": False, "ok": True})
    return _figures(name, result)


def _figures(name: str, result: dict) -> str:
    if result.get("ok") is None:
        return f"n/a ({result.get('why', '')})"
    if "error" in result:
        return result["error"][:100]
    if name == "suite":
        return result.get("summary", "")[:100]
    if name == "raw_cuda_graph":
        return (
            f"{result['replays']} replays over {result['commits']} commits, bitwise "
            f"{result['bitwise_equal_to_eager']}, addresses stable {result['addresses_stable']}, "
            f"syncs {len(result['host_syncs_in_replay'])}"
        )
    if name.startswith("compile"):
        return (
            f"breaks {result['graph_breaks']}, recompiles {result['recompiles']}, "
            f"max diff {result['max_abs_diff']:.2g}" + _cudagraph_cell(result)
        )
    if name == "load_in_graph":
        return f"counted {result['total_counted']} of {result['expected_total']}, equal to eager"
    if name == "host_syncs":
        return ", ".join(f"{k}: {v}" for k, v in result["paths"].items())
    if name == "speed":
        big = result["rows"][-1]
        cells = [f"T={big['tokens']}: ours {big['ours_eager_us']:.1f} us eager"]
        if "ours_graph_us" in big:
            cells.append(f"{big['ours_graph_us']:.1f} us in graph")
        return ", ".join(cells)
    return ""


def _cudagraph_cell(result: dict) -> str:
    return f", cudagraph skips {result['cudagraph_skips']}" if "cudagraph_skips" in result else ""


def _speed_lines(result: dict) -> list[str]:
    rows = result.get("rows") or []
    if not rows:
        return []
    columns = [k for k in rows[0] if k.endswith("_us")]
    lines = ["", f"map_and_record speed (us per call, {result['timer']}):",
             "T      " + " ".join(f"{c[:-3]:>16}" for c in columns)]  # fmt: skip
    for row in rows:
        lines.append(f"{row['tokens']:<6} " + " ".join(f"{row[c]:>16.2f}" for c in columns))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--quick", action="store_true", help="fewer token counts; no suite on CPU")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report: dict = {"environment": _environment(device), "sections": {}}
    if device.type != "cuda":
        print("no CUDA device (torch.cuda.is_available() is False): dry run of the CPU half")
    else:
        print(f"CUDA device: {report['environment']['gpu']}, torch {torch.__version__}")
    started = time.perf_counter()
    for name, body in _sections(device, args.quick):
        print(f"-- {name} ...", flush=True)
        result = _run_section(name, body)
        report["sections"][name] = result
        report["seconds"] = round(time.perf_counter() - started, 1)
        failed = [n for n, r in report["sections"].items() if r.get("ok") is False]
        report["ok"] = not failed
        report["failed"] = failed
        if args.json:
            args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"   {'FAIL' if result.get('ok') is False else 'ok'} ({result['seconds']} s)")

    print()
    print(f"{'check':<26} {'ok':<5} summary")
    for name, result in report["sections"].items():
        ok = {True: "yes", False: "NO", None: "n/a"}[result.get("ok")]
        print(f"{name:<26} {ok:<5} {_summary(name, result)}")
    for line in _speed_lines(report["sections"].get("speed", {})):
        print(line)
    print(f"\n{'all checks passed' if report['ok'] else 'FAILED: ' + ', '.join(report['failed'])}"
          f" in {report['seconds']} s on {device.type}")  # fmt: skip
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
