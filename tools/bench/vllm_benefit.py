"""``bench_vllm.py --benefit``: what EPLB gains on a vLLM engine, batch size by batch size.

Two model shapes (``eplb_graph.models.tiny_qwen3_moe``, bf16, TP=2 + EP, 8 redundant slots):

- **wide**: hidden 1024, 4 layers, 64 experts, top-8, expert intermediate 512 (rows dominate a
  rank's expert time from a few dozen sequences on); router skewed by a Zipf ranking (exponent
  1.2, experts 0, 1, 2, ... hottest, all on EP rank 0 under the default placement), or uniform;
- **small**: hidden 512, 3 layers, 32 experts, top-4, expert intermediate 1024 (a rank's expert
  time is its active experts' weight reads at decode batch sizes); router skewed toward experts
  8-15 (all on EP rank 0, none replicated by the default layout), or uniform.

For each shape and router one process holds the engines, which take turns:

- **off**: EPLB that never rearranges (window = interval = 10**6: the default layout, measured
  by the same clocks);
- **on**: EPLB with vLLM's default ``rearrange="when_it_pays"`` (window 32, interval 64 steps,
  asynchronous): a plan is applied only when the cost model predicts it repays its move;
- **always** (``--always``): the same, with ``rearrange="always"`` and ``min_gain_percent`` 5:
  what eplb-graph did before the cost model;
- **off_again** (``--aa``): a second engine like ``off``, an A/A control: the ratio two identical
  engines read at each point, the noise any other ratio there must beat.

The batch sizes run in ascending order on the same engines (as load grows on a server): per
batch, every engine is warmed up (the EPLB engines for two or more windows at that batch), then
timed in turns (ABBA) on calls of prefill + ``tokens`` decode steps and on prefill-only calls;
the on / off ratio is given both of the median calls and over each pair of neighbouring calls
(median, min, max, and the geometric mean with its 95% interval: the noise at that point).
Per batch and engine: decode throughput, TPOT p50/p99 (the decode steps' serving time, from the
rank files), each rank's mean expert ms per step (the op's own clock), rearrangements and
rollbacks; for the EPLB engines also the cost model's predicted busiest-rank expert ms against
the measured one over each window that closed while the batch was timed, and the speedup the
model predicts over the starting layout.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

PROMPT_TOKENS = 24


def _prompts(count: int) -> list[dict]:
    return [
        {"prompt_token_ids": [(11 * i + 5 * j) % 500 + 3 for j in range(PROMPT_TOKENS)]}
        for i in range(count)
    ]


def _rank_files(folder: Path) -> list[dict]:
    files = []
    for path in sorted(folder.glob("rank*.json")):
        try:
            files.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return files


def benefit_main(spec: dict, out_path: str) -> None:
    """Child process: the engines of one shape and router, every batch size in turn."""
    from vllm import LLM, SamplingParams

    engines = {name: LLM(model=spec["model"], **llm) for name, llm in spec["engines"].items()}
    folders = {name: Path(folder) for name, folder in spec["metrics"].items()}
    names = list(engines)
    decode = SamplingParams(
        max_tokens=spec["tokens"], temperature=0, detokenize=False, ignore_eos=True
    )
    prefill = SamplingParams(max_tokens=1, temperature=0, detokenize=False, ignore_eos=True)
    batches = []
    for batch in spec["batches"]:
        prompts = _prompts(batch)
        start = {name: _rank_files(folder) for name, folder in folders.items()}
        for name, engine in engines.items():
            calls = 1 if name.startswith("off") else spec["warmup_calls"]
            for _ in range(calls):
                engine.generate(prompts, decode, use_tqdm=False)
        time.sleep(2.5)  # the rank files are rewritten at least every 2 s of serving
        before = {name: _rank_files(folder) for name, folder in folders.items()}
        seconds: dict[str, list[float]] = {name: [] for name in engines}
        ttft: dict[str, list[float]] = {name: [] for name in engines}
        for call in range(timed_calls(spec["calls"], batch)):
            for name in names if call % 2 == 0 else reversed(names):
                started = time.perf_counter()
                engines[name].generate(prompts, decode, use_tqdm=False)
                seconds[name].append(time.perf_counter() - started)
                started = time.perf_counter()
                engines[name].generate(prompts, prefill, use_tqdm=False)
                ttft[name].append(time.perf_counter() - started)
        time.sleep(2.5)
        after = {name: _rank_files(folder) for name, folder in folders.items()}
        batches.append(
            {
                "batch": batch,
                "seconds": seconds,
                "ttft": ttft,
                "start": start,
                "before": before,
                "after": after,
            }
        )
    Path(out_path).write_text(json.dumps({"batches": batches}))


def timed_calls(calls: int, batch: int) -> int:
    """Timed calls per engine at ``batch``: ``calls`` from 64 sequences up, up to 4x as many
    below (a call of 8 sequences is a few hundred ms, and on / off differ by noise there unless
    more pairs are taken)."""
    return calls * max(1, min(4, 64 // max(1, batch)))


def _percentile(values: list[float], share: float) -> float | None:
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def _engine_figures(name: str, run: dict, tokens: int) -> dict:
    after, before, start = run["after"][name], run["before"][name], run["start"][name]
    expert_ms = []
    for a, b in zip(after, before, strict=True):
        steps = a.get("expert_steps", 0) - b.get("expert_steps", 0)
        total = a.get("expert_ms_total", 0.0) - b.get("expert_ms_total", 0.0)
        expert_ms.append(total / steps if steps else None)
    decode_steps = after[0].get("decode_steps", 0) - before[0].get("decode_steps", 0)
    recent = after[0].get("decode_step_ms_recent", [])
    timed_steps = recent[-decode_steps:] if decode_steps else []
    call_s = statistics.median(run["seconds"][name])
    prefill_s = statistics.median(run["ttft"][name])
    steps = after[0].get("steps", 0) - before[0].get("steps", 0)
    planning_ms = max(
        (a.get("policy_ms_total", 0.0) - b.get("policy_ms_total", 0.0) for a, b in
         zip(after, before, strict=True)),
        default=0.0,
    )  # fmt: skip
    samples = [a.get("cost_samples") or {} for a in after]
    gate = after[0].get("cost_model") or {}
    gate_start = (start[0].get("cost_model") or {}) if start else {}
    checks = [
        entry
        for entry in gate.get("accuracy") or []
        if before[0].get("steps", 0) < entry["step"] <= after[0].get("steps", 0)
    ]
    figures = {
        "decode_tokens_per_s": run["batch"] * tokens / call_s,
        "call_seconds": run["seconds"][name],
        "decode_step_ms": 1e3 * (call_s - prefill_s) / max(1, tokens - 1),
        "tpot_ms": {
            "p50": _percentile(timed_steps, 0.5),
            "p99": _percentile(timed_steps, 0.99),
            "steps": len(timed_steps),
        },
        "ttft_ms": 1e3 * prefill_s,
        "expert_ms_per_rank": expert_ms,
        "busiest_expert_ms": max((m for m in expert_ms if m is not None), default=None),
        "rearrangements": after[0].get("rearrangements", 0)
        - (start[0].get("rearrangements", 0) if start else 0),
        "rearrangements_total": after[0].get("rearrangements", 0),
        "rollbacks": gate.get("rollbacks", 0) - gate_start.get("rollbacks", 0),
        "rearrange": after[0].get("rearrange"),
        # EPLB's own work on the cores that serve: planning per step (busiest rank), and what
        # share of a decode step that is.
        "planning_ms_per_step": planning_ms / steps if steps else None,
        "cost_samples_dropped": sum(s.get("dropped_outliers", 0) for s in samples),
        "cost_samples_taken": sum(s.get("taken", 0) for s in samples),
    }
    if checks:
        predicted = statistics.median(c["predicted_busiest_ms"] for c in checks)
        measured = statistics.median(c["measured_busiest_ms"] for c in checks)
        initial = statistics.median(c["predicted_busiest_ms_initial"] for c in checks)
        figures["prediction"] = {
            "windows": len(checks),
            "predicted_busiest_ms": predicted,
            "measured_busiest_ms": measured,
            "error": (predicted - measured) / measured,
            "predicted_speedup_over_start": initial / predicted if predicted else None,
        }
    if gate:
        figures["cost_model"] = gate.get("model")
        figures["copy_ms"] = gate.get("copy_ms")
        figures["decisions"] = [
            d
            for d in gate.get("decisions") or []
            if d["step"] > (start[0].get("steps", 0) if start else 0)
        ]
    return figures


def summarize(result: dict, tokens: int) -> list[dict]:
    """Per batch: every engine's figures and the on/off ratios (see the module docstring)."""
    rows = []
    for run in result["batches"]:
        engines = {name: _engine_figures(name, run, tokens) for name in run["seconds"]}
        off = engines["off"]
        row = {"batch": run["batch"], "engines": engines}
        for name, figures in engines.items():
            if name == "off":
                continue
            busiest_on, busiest_off = figures["busiest_expert_ms"], off["busiest_expert_ms"]
            pairs = _paired_ratios(run["seconds"]["off"], run["seconds"][name])
            row[name] = {
                "decode_speedup": figures["decode_tokens_per_s"] / off["decode_tokens_per_s"],
                # Call k of each engine ran next to each other (ABBA): their ratio cancels the
                # machine's slow drifts; the spread over pairs is the noise at this point.
                "decode_speedup_pairs": {
                    "median": statistics.median(pairs),
                    "min": min(pairs),
                    "max": max(pairs),
                    "count": len(pairs),
                    **paired_interval(pairs),
                },
                "expert_speedup_measured": busiest_off / busiest_on
                if busiest_on and busiest_off
                else None,
                "expert_speedup_predicted": (figures.get("prediction") or {}).get(
                    "predicted_speedup_over_start"
                ),
                "prediction_error": (figures.get("prediction") or {}).get("error"),
                "rearrangements": figures["rearrangements"],
                "rollbacks": figures["rollbacks"],
            }
        rows.append(row)
    return rows


def _paired_ratios(off: list[float], on: list[float]) -> list[float]:
    """off / on call time of each pair of calls made next to each other (> 1: on faster)."""
    return [a / b for a, b in zip(off, on, strict=True)]


T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip
"""Student's t, two-sided 95%, for 1..30 degrees of freedom (1.96 beyond)."""


def paired_interval(pairs: list[float]) -> dict:
    """The pairs' geometric-mean ratio and its 95% confidence interval (Student's t on the log
    ratios: a pair's ratio is a product of the machine's drift and the engines' difference, so
    logs make the noise additive). Why: at a small batch two engines serving the *same*
    placement differ by a few percent call to call on this shared machine, so a point estimate
    of 0.98x says nothing by itself; the interval says whether on was slower beyond that."""
    logs = [math.log(p) for p in pairs if p > 0]
    if len(logs) < 2:
        return {"geomean": math.exp(logs[0]) if logs else None, "low": None, "high": None}
    mean = statistics.fmean(logs)
    freedom = len(logs) - 1
    t = T_975[freedom - 1] if freedom <= len(T_975) else 1.96
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return {"geomean": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half)}


def pyplot():
    """matplotlib's pyplot on the file-only backend, or ``None`` where it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(report: dict, path: Path) -> bool:
    """Decode throughput on / off against the batch size, one line per shape and router."""
    plt = pyplot()
    if plt is None:
        return False
    figure, axis = plt.subplots(figsize=(7, 4))
    for key, curve in report["curves"].items():
        for engine in ("on", "always"):
            points = [(r["batch"], r[engine]["decode_speedup"]) for r in curve if engine in r]
            if points:
                style = "-o" if engine == "on" else ":x"
                label = f"{key} ({'when_it_pays' if engine == 'on' else 'always'})"
                axis.plot(*zip(*points, strict=True), style, label=label)
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.axhline(0.99, color="grey", linewidth=0.5, linestyle="--")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("concurrent sequences (decode batch)")
    axis.set_ylabel("decode throughput, EPLB on / off")
    axis.set_title("eplb-graph on vLLM CPU, TP=2 + EP")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
