"""``bench_vllm.py --drift``: EPLB on a vLLM engine under traffic whose hot experts move.

Model: ``eplb_graph.models.tiny_qwen3_moe`` with a router that follows the tokens
(``domains``): the small shape of the benefit curve (hidden 512, 3 layers, 32 experts, top-4,
expert intermediate 1024, bf16), a **code** domain whose hot experts are 8-15 (all on EP rank 0
under the default layout, none replicated) and a **chat** domain whose hot experts are 24-31
(all on rank 1); neutral tokens route evenly. TP=2 + EP, compiled, 8 redundant slots.

Phases, in order, each ``rounds`` rounds of ``batch`` sequences (24 prompt tokens, 32 sampled
tokens, a seed per sequence so every engine serves the very same requests):

- **code**: every sequence from the code domain (skew on rank 0);
- **chat**: the skew moved to rank 1;
- **mixed**: half code, half chat (the default layout is even here; a layout tuned for one
  domain is not);
- **uniform**: neutral tokens.

Engines, one process, taking turns every round (ABBA): **off** (EPLB that never rearranges),
**on** (vLLM's defaults and eplb-graph's: ``rearrange: when_it_pays``, window 32 / interval 64
steps, asynchronous) and, with ``--aa``, **off_again** (an A/A control). After every round the
on engine's rank file is read: rearrangements, aborted windows, planning failures, the gate's
decisions (deduplicated by step) and its ledger of moves; the on engine also records its windows
(``record_windows``) so ``eplb-graph simulate --windows`` can replay them.

Per phase: decode throughput on / off over the first ``FIRST_ROUNDS`` rounds after the shift and
over the rounds once adapted (from the round after the first move of the phase, or the third
round when none was needed), each with the pairs' geometric mean and 95% interval
(``vllm_benefit.paired_interval``); windows from the shift to the first move; decisions.
The whole run: each engine's median call per phase, weighted by the phase's rounds.
"""

from __future__ import annotations

import json
import random
import statistics
import time
import zlib
from pathlib import Path

from vllm_benefit import paired_interval, pyplot

PROMPT_TOKENS = 24
FIRST_ROUNDS = 3
PHASES = ("code", "chat", "mixed", "uniform")
CODE_EXPERTS = tuple(range(8, 16))
CHAT_EXPERTS = tuple(range(24, 32))


def phase_prompts(phase: str, batch: int, round_index: int, seed: int) -> list[dict]:
    """``batch`` prompts of the phase's tokens, the same for every engine."""
    from eplb_graph.models.tiny_qwen3_moe import domain_tokens

    generator = random.Random(f"{seed}/{phase}/{round_index}")
    domains = {"code": [0], "chat": [1], "mixed": [0, 1], "uniform": [2]}[phase]
    prompts = []
    for index in range(batch):
        tokens = domain_tokens(domains[index % len(domains)], 2)
        prompts.append(
            {
                "prompt_token_ids": [
                    generator.randrange(tokens.start, tokens.stop) for _ in range(PROMPT_TOKENS)
                ]
            }
        )
    return prompts


def _rank_file(folder: Path) -> dict:
    try:
        return json.loads((folder / "rank0.json").read_text())
    except (OSError, ValueError):
        return {}


def drift_main(spec: dict, out_path: str) -> None:
    """Child process: the engines, every phase's rounds in turn."""
    from vllm import LLM, SamplingParams

    engines = {name: LLM(model=spec["model"], **llm) for name, llm in spec["engines"].items()}
    names = list(engines)
    on_folder = Path(spec["metrics"]["on"])

    def sampling(phase: str, round_index: int) -> list:
        """Sampled tokens (temperature 1: sequences of a domain do not all repeat one token),
        seeded per sequence: every engine serves the very same tokens."""
        return [
            SamplingParams(
                max_tokens=spec["tokens"],
                temperature=1.0,
                detokenize=False,
                ignore_eos=True,
                seed=zlib.crc32(f"{spec['seed']}/{phase}/{round_index}/{i}".encode()),
            )
            for i in range(spec["batch"])
        ]

    warmup = phase_prompts("uniform", spec["batch"], -1, spec["seed"])
    for engine in engines.values():
        for _ in range(spec["warmup_calls"]):
            engine.generate(warmup, sampling("warmup", 0), use_tqdm=False)
    time.sleep(2.2)
    after_warmup = _rank_file(on_folder)
    rounds = []
    for phase in spec["phases"]:
        for index in range(spec["rounds"]):
            prompts = phase_prompts(phase, spec["batch"], index, spec["seed"])
            params = sampling(phase, index)
            seconds = {}
            for name in names if index % 2 == 0 else reversed(names):
                started = time.perf_counter()
                engines[name].generate(prompts, params, use_tqdm=False)
                seconds[name] = time.perf_counter() - started
            time.sleep(2.2)  # the rank files are rewritten at least every 2 s of serving
            rounds.append({"phase": phase, "round": index, "seconds": seconds,
                           "on": _rank_file(on_folder)})  # fmt: skip
    Path(out_path).write_text(json.dumps({"rounds": rounds, "after_warmup": after_warmup}))


def summarize(result: dict, batch: int, tokens: int) -> dict:
    """Per phase on / off figures, the on engine's decisions and moves, and the verdict's
    inputs (see the module docstring)."""
    rounds = result["rounds"]
    decisions: dict[int, dict] = {}
    for entry in rounds:
        for decision in (entry["on"].get("cost_model") or {}).get("decisions") or []:
            decisions[decision["step"]] = decision
    steps_at = [entry["on"].get("steps", 0) for entry in rounds]
    warmup_steps = (result.get("after_warmup") or {}).get("steps", 0)
    phases = {}
    for phase in dict.fromkeys(entry["phase"] for entry in rounds):
        index = [i for i, entry in enumerate(rounds) if entry["phase"] == phase]
        start_step = steps_at[index[0] - 1] if index[0] > 0 else warmup_steps
        end_step = steps_at[index[-1]]
        moves = [
            d
            for step, d in sorted(decisions.items())
            if start_step < step <= end_step and d["action"] in ("applied", "rollback")
        ]
        windows = [step for step in sorted(decisions) if start_step < step <= end_step]
        first_move = moves[0]["step"] if moves else None
        adapted_round = FIRST_ROUNDS
        if first_move is not None:
            adapted_round = next(
                (k + 1 for k, i in enumerate(index) if steps_at[i] >= first_move), len(index)
            )
            adapted_round = max(adapted_round, FIRST_ROUNDS)
        phases[phase] = {
            "rounds": len(index),
            "first": _segment(rounds, index[:FIRST_ROUNDS], batch, tokens),
            "adapted": _segment(rounds, index[adapted_round:], batch, tokens),
            "all": _segment(rounds, index, batch, tokens),
            "adapted_from_round": adapted_round,
            "windows": len(windows),
            "windows_to_first_move": (
                sum(step <= first_move for step in windows) if first_move is not None else None
            ),
            "moves": [
                {
                    "step": d["step"],
                    "action": d["action"],
                    "candidate": d.get("candidate"),
                    "copies": d.get("copies"),
                }
                for d in moves
            ],
            "decisions": [decisions[step] for step in windows],
        }
    ratios = [entry["seconds"]["off"] / entry["seconds"]["on"] for entry in rounds]
    planning = [entry["on"].get("policy_ms_total", 0.0) for entry in rounds]
    moved_steps = [step for step, d in decisions.items() if d["action"] in ("applied", "rollback")]
    move_rounds = [
        next((i + 1 for i, at in enumerate(steps_at) if at >= step), len(rounds))
        for step in moved_steps
    ]
    last = rounds[-1]["on"]
    gate = last.get("cost_model") or {}
    moves = gate.get("moves") or []
    measured = [m for m in moves if m.get("net_ms") is not None]
    return {
        "phases": phases,
        "round_ratios": ratios,
        "round_seconds": [entry["seconds"] for entry in rounds],
        "round_planning_ms": [b - a for a, b in zip([0.0, *planning[:-1]], planning, strict=True)],
        "move_rounds": move_rounds,
        "whole": _segment(rounds, list(range(len(rounds))), batch, tokens, by_phase=True),
        "rearrangements": last.get("rearrangements"),
        "aborted": last.get("aborted"),
        "planning_failures": last.get("planning_failures"),
        "last_decision": last.get("last_decision"),
        "moves": moves,
        "moves_repaid": sum(m["net_ms"] > 0 for m in measured),
        "moves_measured": len(measured),
        "copy_ms": gate.get("copy_ms"),
        "cost_model": gate.get("model"),
    }


def _segment(
    rounds: list[dict], index: list[int], batch: int, tokens: int, by_phase: bool = False
) -> dict | None:
    """Decode throughput of every engine over some rounds (of its median call), the ratio of
    median calls against off, and each engine's pairs against off (one pair per round: they ran
    next to each other). ``by_phase``: the rounds span phases, and an engine's call is the mean
    of each phase's median call weighted by its rounds (a skewed phase's calls take 1.5x an even
    one's without EPLB: one median over both falls on whichever side holds the middle round,
    and put one run's whole at 1.42x where its phases were 1.01-1.48x)."""
    if not index:
        return None
    names = list(rounds[index[0]]["seconds"])
    groups = [index]
    if by_phase:
        phases = dict.fromkeys(rounds[i]["phase"] for i in index)
        groups = [[i for i in index if rounds[i]["phase"] == phase] for phase in phases]
    medians = {
        name: sum(
            statistics.median(rounds[i]["seconds"][name] for i in group) * len(group)
            for group in groups
        )
        / len(index)
        for name in names
    }
    figures = {name: {"decode_tokens_per_s": batch * tokens / medians[name]} for name in names}
    for name in names:
        if name == "off":
            continue
        pairs = [rounds[i]["seconds"]["off"] / rounds[i]["seconds"][name] for i in index]
        # Ratio of the median calls: one call that a burst of other work stalled (seen: 2.6x,
        # on either engine) does not decide a phase.
        figures[name]["speedup"] = medians["off"] / medians[name]
        figures[name]["pairs"] = {"median": statistics.median(pairs), "count": len(pairs),
                                  **paired_interval(pairs)}  # fmt: skip
    return figures


DRIFT_GOALS = {
    "skewed_adapted_min": 1.15,
    "first_rounds_min": 0.95,
    "even_min": 0.99,
    "whole_min": 1.10,
    "windows_to_adapt_max": 2,
    "repaid_share_min": 0.75,
}


def within_aa(run: dict, phase: str, segment: str) -> bool | None:
    """Whether on against off lies within the A/A control's 95% interval or above it (the pairs'
    geometric mean of on / off at least the low end of off_again / off's interval), ``None``
    without an A/A engine. Why: two identical never-moving engines differ by up to 20% over a
    phase on this shared machine; an on / off ratio that two identical engines also show is
    not EPLB's doing."""
    figures = (run["phases"].get(phase) or {}).get(segment)
    if figures is None or "off_again" not in figures:
        return None
    on, control = figures["on"]["pairs"], figures["off_again"]["pairs"]
    if on.get("geomean") is None or control.get("low") is None:
        return None
    return on["geomean"] >= control["low"]


def verdict(runs: list[dict]) -> dict:
    """The goals, judged on the worst of the repeated runs; an even phase (mixed, uniform) of a
    run passes at >= 0.99x or where its on / off lies within the A/A interval (the issue's goal:
    "mixed and uniform phases >= 0.99x (or within the A/A interval)"), each phase on its own."""

    def worst(values):
        values = [v for v in values if v is not None]
        return min(values) if values else None

    def speed(run, phase, segment):
        figures = (run["phases"].get(phase) or {}).get(segment)
        return None if figures is None else figures["on"]["speedup"]

    skewed = [speed(r, p, "adapted") for r in runs for p in ("code", "chat")]
    first = [speed(r, p, "first") for r in runs for p in ("chat", "mixed", "uniform")]
    even = [speed(r, p, "all") for r in runs for p in ("mixed", "uniform")]
    even_noise = [within_aa(r, p, "all") for r in runs for p in ("mixed", "uniform")]
    first_noise = [within_aa(r, p, "first") for r in runs for p in ("chat", "mixed", "uniform")]
    adapt = [r["phases"][p]["windows_to_first_move"] for r in runs for p in ("code", "chat")
             if p in r["phases"]]  # fmt: skip
    repaid = [r["moves_repaid"] / r["moves_measured"] for r in runs if r["moves_measured"]]
    goals = DRIFT_GOALS
    result = {
        "skewed_adapted_worst": worst(skewed),
        "first_rounds_worst": worst(first),
        "even_worst": worst(even),
        "even_within_aa": even_noise,
        "first_rounds_within_aa": first_noise,
        "whole_worst": worst(r["whole"]["on"]["speedup"] for r in runs),
        "windows_to_adapt_worst": max((a for a in adapt if a is not None), default=None),
        "adapt_missing": sum(a is None for a in adapt),
        "aborted": sum(r["aborted"] or 0 for r in runs),
        "planning_failures": sum(r["planning_failures"] or 0 for r in runs),
        "repaid_share_worst": worst(repaid),
    }
    result["met"] = {
        "skewed_adapted": (result["skewed_adapted_worst"] or 0) >= goals["skewed_adapted_min"],
        "first_rounds": (result["first_rounds_worst"] or 0) >= goals["first_rounds_min"],
        "even": bool(even)
        and all(
            (speedup or 0) >= goals["even_min"] or noise is True
            for speedup, noise in zip(even, even_noise, strict=True)
        ),
        "whole": (result["whole_worst"] or 0) >= goals["whole_min"],
        "adapt": result["adapt_missing"] == 0
        and (result["windows_to_adapt_worst"] or 0) <= goals["windows_to_adapt_max"],
        "no_aborts": result["aborted"] == 0,
        "repaid": (result["repaid_share_worst"] or 0) >= goals["repaid_share_min"],
    }
    return result


def plot(report: dict, path: Path) -> bool:
    """Per round, decode throughput on / off of every run (dashed: the A/A control), phases
    shaded, moves marked."""
    plt = pyplot()
    if plt is None:
        return False
    figure, axis = plt.subplots(figsize=(9, 4))
    rounds = report["rounds_per_phase"]
    for number, run in enumerate(report["runs"]):
        ratios = run["round_ratios"]
        axis.plot(range(1, len(ratios) + 1), ratios, "-o", markersize=3, label=f"run {number}")
        for marker in run["move_rounds"]:
            axis.axvline(marker, color=f"C{number}", alpha=0.3, linewidth=0.8)
        control = [s["off"] / s["off_again"] for s in run["round_seconds"] if "off_again" in s]
        if control:  # the A/A control: what two identical engines read, the noise to beat
            axis.plot(
                range(1, len(control) + 1), control, "--", color=f"C{number}", alpha=0.45,
                linewidth=0.9, label=f"run {number}: A/A (off_again / off)",
            )  # fmt: skip
    for index, phase in enumerate(report["phases"]):
        axis.axvspan(index * rounds + 0.5, (index + 1) * rounds + 0.5, alpha=0.06 * (index % 2))
        axis.text(index * rounds + 1, 0.02, phase, transform=axis.get_xaxis_transform())
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xlabel("round (one call of every engine; thin lines: EPLB moves)")
    axis.set_ylabel("decode throughput, EPLB on / off")
    axis.set_title("eplb-graph on vLLM CPU while the hot experts move")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
