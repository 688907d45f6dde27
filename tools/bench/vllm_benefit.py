"""``bench_vllm.py --benefit``: does EPLB make a vLLM engine faster when experts dominate a step?

A Qwen3-MoE written by ``eplb_graph.models.tiny_qwen3_moe`` (full: hidden 1024, 4 layers, 64
experts, top-8, expert intermediate 512, bf16; quick: intermediate 256, eager), its router skewed
by a Zipf-ranked popularity (exponent 1.2, hottest experts 0, 1, 2, ... all on EP rank 0 under
the default placement), and the same shape with a uniform router (the no-harm case). For each
router two engines in one process, taking turns (ABBA), TP=2 + EP, 8 redundant slots both:

- **off**: EPLB enabled with window = interval = 10**6 (it never rearranges: the default layout,
  with the same metrics files, so both sides are measured by the same clock);
- **on**: EPLB rearranging (window 32, interval 64 steps, asynchronous), warmed up until it has
  committed a rearrangement.

Each rank computes only its own rows (``torch.ops.eplb_graph.vllm_local_experts``), so the
placement decides the busiest rank's work. Reported per engine: decode throughput (tokens/s over
timed calls of prefill + decode), the decode step time alone (a call's time less a prefill-only
call's, per later token), TPOT p50/p99 (per-step serving time from the rank files), TTFT of a
prefill batch,
each rank's median expert ms per step and rows computed, the measured balancedness (mean / max of
per-rank expert ms), the count balancedness, and the speedup the counts predict (busiest rank's
rows off / on).
"""

from __future__ import annotations

import json
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
    """Child process: both engines of one router, warmed up, then timed in turns."""
    from vllm import LLM, SamplingParams

    engines = {name: LLM(model=spec["model"], **llm) for name, llm in spec["engines"].items()}
    folders = {name: Path(folder) for name, folder in spec["metrics"].items()}
    prompts = _prompts(spec["prompts"])
    decode = SamplingParams(
        max_tokens=spec["tokens"], temperature=0, detokenize=False, ignore_eos=True
    )
    prefill = SamplingParams(max_tokens=1, temperature=0, detokenize=False, ignore_eos=True)
    for engine in engines.values():
        engine.generate(prompts, decode, use_tqdm=False)
    for _ in range(spec["max_warmup_calls"]):  # until the EPLB-on engine has rearranged
        files = _rank_files(folders["on"])
        if files and min(f.get("rearrangements", 0) for f in files) >= spec["min_rearrangements"]:
            break
        engines["on"].generate(prompts, decode, use_tqdm=False)
    time.sleep(2.5)  # let the rank files catch up (rewritten at least every 2 s of serving)
    before = {name: _rank_files(folder) for name, folder in folders.items()}
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    ttft: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for call in range(spec["calls"]):
        for name in names if call % 2 == 0 else reversed(names):
            started = time.perf_counter()
            engines[name].generate(prompts, decode, use_tqdm=False)
            seconds[name].append(time.perf_counter() - started)
            started = time.perf_counter()
            engines[name].generate(prompts, prefill, use_tqdm=False)
            ttft[name].append(time.perf_counter() - started)
    time.sleep(2.5)
    after = {name: _rank_files(folder) for name, folder in folders.items()}
    Path(out_path).write_text(
        json.dumps({"seconds": seconds, "ttft": ttft, "before": before, "after": after})
    )


def summarize(result: dict, tokens: int, prompts: int) -> dict:
    """Per engine figures and the on/off ratios (see the module docstring)."""
    engines = {}
    for name, seconds in result["seconds"].items():
        after, before = result["after"][name], result["before"][name]
        rows = [
            a.get("expert_rows", 0) - b.get("expert_rows", 0)
            for a, b in zip(after, before, strict=True)
        ]
        expert = [(a.get("expert_ms") or {}).get("p50") or 0.0 for a in after]
        steps = [a["step_ms"]["idle"] for a in after]
        busiest = max(expert) if expert else 0.0
        call_s, prefill_s = statistics.median(seconds), statistics.median(result["ttft"][name])
        engines[name] = {
            "decode_tokens_per_s": prompts * tokens / call_s,
            # A call's time less a prefill-only call's, per later token: the decode steps alone.
            "decode_step_ms": 1e3 * (call_s - prefill_s) / max(1, tokens - 1),
            "tpot_ms": {"p50": steps[0].get("p50"), "p99": steps[0].get("p99")},
            "ttft_ms": 1e3 * statistics.median(result["ttft"][name]),
            "expert_ms_per_rank": expert,
            "expert_rows_per_rank": rows,
            "balancedness_measured": sum(expert) / len(expert) / busiest if busiest else None,
            "balancedness_counts": sum(rows) / len(rows) / max(rows)
            if max(rows, default=0)
            else None,
            "rearrangements": after[0].get("rearrangements", 0),
        }
    on, off = engines["on"], engines["off"]
    predicted = (
        max(off["expert_rows_per_rank"]) / max(on["expert_rows_per_rank"])
        if max(on["expert_rows_per_rank"], default=0)
        else None
    )
    measured = (
        max(off["expert_ms_per_rank"]) / max(on["expert_ms_per_rank"])
        if max(on["expert_ms_per_rank"], default=0)
        else None
    )
    return {
        "engines": engines,
        "decode_speedup": on["decode_tokens_per_s"] / off["decode_tokens_per_s"],
        "decode_step_speedup": off["decode_step_ms"] / on["decode_step_ms"],
        "expert_speedup_measured": measured,
        "expert_speedup_predicted_by_counts": predicted,
        "measured_over_predicted": measured / predicted if measured and predicted else None,
    }
