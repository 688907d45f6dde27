"""vLLM engine with eplb-graph: what EPLB costs a decode step, idle and while it moves weights.

Two measurements on the tiny Qwen3-MoE (``eplb_graph.models.tiny_qwen3_moe``), 2 EP ranks with 2
redundant slots, float32, one core per rank (``VLLM_CPU_OMP_THREADS_BIND='0|1'``):

1. **Overhead with nothing pending**: decode step time with EPLB on (recording every step, no
   window close during the measurement: window = interval = 10**6) against EPLB off (expert
   parallelism only), **the same layout** (no redundant slots, so both compute the same
   experts). A third engine, EPLB on with 2 redundant slots, shows what the extra slots
   themselves cost (more experts per rank), which is a layout choice, not EPLB's overhead. The
   engines live in one process and take turns (rotating order), so a burst of load from
   elsewhere on this shared machine hits all alike; each call generates 4 prompts x T new
   tokens after a warm-up call, and a step is one call's time / T. Goal: on/off at most 1.02.
   (Each rank is pinned to one core, so the per-rank thread count is 1; 2 threads per rank
   would oversubscribe the 2 cores.)
2. **Step time while a rearrangement is in flight**: an EPLB engine rebalancing every
   ``interval`` steps (asynchronous, the default policy) records every serving step's time
   (commits, forward, sampling) split by whether a rearrangement was in flight; the p99 of the
   in-flight steps against the p99 of the idle steps. Goal: at most 1.2x.

Each engine runs in a fresh process of this script (``--engine SPEC``), so vLLM's process-wide
state never leaks between engines. ``--quick`` uses eager engines and fewer steps.

    python tools/bench/bench_vllm.py [--quick] [--json PATH]
    python tools/bench/bench_vllm.py --benefit [--quick] [--json PATH]

``--benefit`` measures what EPLB gains instead (tools/bench/vllm_benefit.py): the benefit curve,
decode throughput, TPOT and the busiest rank's expert time with EPLB on against off at every
batch size of ``--batch`` (default 8,24,64,256), on two model shapes, skewed and uniform routers,
with the cost model's predicted busiest-rank time against the measured one.

    python tools/bench/bench_vllm.py --benefit [--batch 8,24,64,256] [--always] [--plot PNG]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import run_benchmark, write_report

PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(5 + 3 * i)] for i in range(4)]
OVERHEAD_GOAL = 1.02
IN_FLIGHT_GOAL = 1.2
# One engine process serves a whole drift repeat (3 engines x 40 rounds): ~30 min here.
ENGINE_RUN_TIMEOUT_S = 3 * 3600


def engine_main(spec_path: str, out_path: str) -> None:
    """Child process: the spec's engines, timed ``generate`` calls in turns (ABBA)."""
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("kind") == "benefit":
        from vllm_benefit import benefit_main

        benefit_main(spec, out_path)
        return
    if spec.get("kind") == "drift":
        from vllm_drift import drift_main

        drift_main(spec, out_path)
        return
    engines = {name: LLM(model=spec["model"], **llm) for name, llm in spec["engines"].items()}
    prompts = [{"prompt_token_ids": prompt} for prompt in PROMPTS]
    sampling = SamplingParams(
        max_tokens=spec["tokens"], temperature=0, detokenize=False, ignore_eos=True
    )
    for engine in engines.values():  # warm-up: first-batch costs, caches
        engine.generate(prompts, sampling, use_tqdm=False)
    names = list(engines)
    step_seconds: dict[str, list[float]] = {name: [] for name in names}
    for call in range(spec["calls"]):
        for name in names if call % 2 == 0 else reversed(names):
            started = time.perf_counter()
            engines[name].generate(prompts, sampling, use_tqdm=False)
            step_seconds[name].append((time.perf_counter() - started) / spec["tokens"])
    Path(out_path).write_text(json.dumps({"step_seconds": step_seconds}))


def run_engine(root: Path, name: str, spec: dict) -> dict:
    spec_path, out_path = root / f"{name}.spec.json", root / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    for variable, folder in (
        ("TMPDIR", "tmp"),
        ("VLLM_CACHE_ROOT", "vllm"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("XDG_CACHE_HOME", "xdg"),
    ):
        (root / folder).mkdir(exist_ok=True)
        env.setdefault(variable, str(root / folder))
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="0|1",
        VLLM_PLUGINS="eplb_graph",
    )
    started = time.perf_counter()
    with open(root / f"{name}.log", "w") as log:
        done = subprocess.run(
            [sys.executable, __file__, "--engine", str(spec_path), str(out_path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=ENGINE_RUN_TIMEOUT_S,
        )
    if done.returncode != 0:  # the log lives in a temporary folder: show its end now
        tail = (root / f"{name}.log").read_text(errors="replace").splitlines()[-150:]
        print("\n".join(tail), file=sys.stderr)
        raise RuntimeError(f"engine run {name!r} exited with {done.returncode}")
    result = json.loads(out_path.read_text())
    result["wall_seconds"] = time.perf_counter() - started
    return result


def engine_kwargs(*, eplb: dict | None, eager: bool) -> dict:
    llm = {
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "max_model_len": 512,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 256,
        "seed": 0,
        "enforce_eager": eager,
        "tensor_parallel_size": 2,
        "enable_expert_parallel": True,
    }
    if eplb is not None:
        llm.update(enable_eplb=True, **eplb)
    return llm


def overhead(root: Path, model: Path, args) -> dict:
    """Decode step time, EPLB on with nothing pending against EPLB off, in turns."""

    def never(redundant: int) -> dict:
        return {
            "eplb_config": {
                "window_size": 10**6,
                "step_interval": 10**6,
                "num_redundant_experts": redundant,
            }
        }

    tokens, calls = (48, 6) if args.quick else (96, 12)
    spec = {
        "model": str(model),
        "engines": {
            "off": engine_kwargs(eplb=None, eager=args.quick),
            "on": engine_kwargs(eplb=never(0), eager=args.quick),
            "on_r2": engine_kwargs(eplb=never(2), eager=args.quick),
        },
        "tokens": tokens,
        "calls": calls,
    }
    result = run_engine(root, "overhead", spec)
    steps = result["step_seconds"]
    medians = {variant: statistics.median(values) for variant, values in steps.items()}
    ratio = medians["on"] / medians["off"]
    for variant in ("off", "on", "on_r2"):
        print(
            f"  {variant:>3}: median step {1e3 * medians[variant]:.2f} ms over {calls} calls x "
            f"{tokens} tokens"
        )
    return {
        "mode": "eager" if args.quick else "compiled",
        "tokens_per_call": tokens,
        "calls_per_engine": calls,
        "step_ms": {variant: [1e3 * s for s in values] for variant, values in steps.items()},
        "median_step_ms": {variant: 1e3 * value for variant, value in medians.items()},
        "ratio_on_over_off": ratio,
        "ratio_on_r2_over_off": medians["on_r2"] / medians["off"],
        "goal": OVERHEAD_GOAL,
        "met": ratio <= OVERHEAD_GOAL,
    }


def in_flight(root: Path, model: Path, args) -> dict:
    """p99 step time while a rearrangement is in flight against idle steps, one engine."""
    interval = 24 if args.quick else 40
    metrics_dir = root / "in-flight-metrics"
    eplb = {
        "eplb_config": {
            "window_size": interval // 2,
            "step_interval": interval,
            "num_redundant_experts": 2,
        },
        "additional_config": {"eplb_graph": {"metrics_path": str(metrics_dir)}},
    }
    tokens, calls = (64, 3) if args.quick else (120, 5)
    spec = {
        "model": str(model),
        "engines": {"eplb": engine_kwargs(eplb=eplb, eager=args.quick)},
        "tokens": tokens,
        "calls": calls,
    }
    run_engine(root, "in-flight", spec)
    rank = json.loads((metrics_dir / "rank0.json").read_text())
    idle, busy = rank["step_ms"]["idle"], rank["step_ms"]["rearranging"]
    ratio = busy["p99"] / idle["p99"] if idle.get("count") and busy.get("count") else None
    return {
        "mode": "eager" if args.quick else "compiled",
        "step_interval": interval,
        "rearrangements": rank["rearrangements"],
        "aborted": rank["aborted"],
        "layers_committed": rank["layers_committed"],
        "idle_ms": idle,
        "in_flight_ms": busy,
        "ratio_p99_in_flight_over_idle": ratio,
        "goal": IN_FLIGHT_GOAL,
        "met": ratio is not None and ratio <= IN_FLIGHT_GOAL,
    }


MIN_GAIN_PERCENT = 5
"""The ``always`` engine (``--always``) applies a plan only if it cuts the busiest rank's load by
5%, as the benefit benchmark's EPLB engine did before the cost model."""
BENEFIT_GOALS = {
    "decode_ratio_min": 0.99,
    "skewed_best": 1.40,
    "skewed_rows_dominate_from_64": 1.15,
    "prediction_error_max": 0.15,
}
SHAPES = {
    "wide": {
        "model": {
            "hidden_size": 1024, "num_layers": 4, "num_experts": 64, "top_k": 8,
            "moe_intermediate_size": 512,
        },
        "routers": {
            "skewed": {"router_zipf": 1.2, "hot_experts": ()},
            "uniform": {"router_zipf": 0.0, "hot_experts": ()},
        },
    },
    "small": {
        "model": {
            "hidden_size": 512, "num_layers": 3, "num_experts": 32, "top_k": 4,
            "moe_intermediate_size": 1024,
        },
        "routers": {
            # Experts 8-15: on rank 0, and not among the 8 that the default layout replicates.
            "skewed": {"router_zipf": None, "hot_experts": tuple(range(8, 16))},
            "uniform": {"router_zipf": None, "hot_experts": ()},
        },
    },
}  # fmt: skip
REDUNDANT = 8


def benefit(root: Path, args) -> dict:
    """EPLB on against off, every batch size of the curve, per shape and router."""
    from vllm_benefit import summarize, timed_calls

    from eplb_graph.models.tiny_qwen3_moe import write_tiny_qwen3_moe

    default_batches = "8,64" if args.quick else "8,24,64,256"
    batches = sorted(int(b) for b in (args.batch or default_batches).split(","))
    tokens, calls, warmup = (16, 2, 3) if args.quick else (32, 4, 4)
    calls = args.calls or calls
    report = {
        "mode": "eager" if args.quick else "compiled",
        "batches": batches,
        "decode_tokens": tokens,
        "calls_per_engine": calls,
        "timed_calls": {batch: timed_calls(calls, batch) for batch in batches},
        "warmup_calls": warmup,
        "redundant": REDUNDANT,
        "goals": BENEFIT_GOALS,
        "shapes": {name: shape["model"] for name, shape in SHAPES.items()},
        "curves": {},
    }
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        for router in args.routers.split(","):
            key = f"{shape_name}/{router}"
            model = write_tiny_qwen3_moe(
                root / f"benefit-{shape_name}-{router}",
                dtype="bfloat16",
                **shape["model"],
                **shape["routers"][router],
            )
            names = [
                "off",
                "on",
                *(["always"] if args.always else []),
                *(["off_again"] if args.aa else []),
            ]
            metrics = {name: str(root / f"benefit-{shape_name}-{router}-{name}") for name in names}

            def engine(name: str, metrics=metrics) -> dict:
                never = name.startswith("off")
                section = {"metrics_path": metrics[name]}
                if name == "always":
                    section.update(rearrange="always", min_gain_percent=MIN_GAIN_PERCENT)
                llm = engine_kwargs(
                    eplb={
                        "eplb_config": {
                            "window_size": 10**6 if never else 32,
                            "step_interval": 10**6 if never else 64,
                            "num_redundant_experts": REDUNDANT,
                        },
                        "additional_config": {"eplb_graph": section},
                    },
                    eager=args.quick,
                )
                llm.update(
                    dtype="bfloat16",
                    max_num_seqs=max(batches),
                    max_num_batched_tokens=max(512, max(batches)),
                )
                return llm

            spec = {
                "kind": "benefit",
                "model": str(model),
                "engines": {name: engine(name) for name in names},
                "metrics": metrics,
                "batches": batches,
                "tokens": tokens,
                "calls": calls,
                "warmup_calls": warmup,
            }
            curve = summarize(run_engine(root, f"benefit-{shape_name}-{router}", spec), tokens)
            report["curves"][key] = curve
            for row in curve:
                for name in names[1:]:
                    ratios, figures = row[name], row["engines"][name]
                    prediction = figures.get("prediction") or {}
                    pairs = ratios["decode_speedup_pairs"]
                    print(
                        f"  {key} {row['batch']:>4} seq {name:>6}: decode "
                        f"{figures['decode_tokens_per_s']:.0f} vs "
                        f"{row['engines']['off']['decode_tokens_per_s']:.0f} tok/s "
                        f"({ratios['decode_speedup']:.3f}x; pairs {pairs['median']:.3f}x, "
                        f"{pairs['min']:.3f}-{pairs['max']:.3f}, 95% "
                        f"{_fmt(pairs['low'])}-{_fmt(pairs['high'])}); planning "
                        f"{_fmt(figures['planning_ms_per_step'])} ms/step; expert busiest "
                        f"{_fmt(figures['busiest_expert_ms'])} vs "
                        f"{_fmt(row['engines']['off']['busiest_expert_ms'])} ms "
                        f"(measured {_fmt(ratios['expert_speedup_measured'])}x, predicted "
                        f"{_fmt(ratios['expert_speedup_predicted'])}x); prediction error "
                        f"{_fmt(prediction.get('error'))}; "
                        f"{ratios['rearrangements']} rearrangements, "
                        f"{ratios['rollbacks']} rollbacks",
                        flush=True,
                    )
    report["verdict"] = _benefit_verdict(report)
    return report


DRIFT_SHAPE = {
    "hidden_size": 512, "num_layers": 3, "num_experts": 32, "top_k": 4,
    "moe_intermediate_size": 1024,
}  # fmt: skip


def drift(root: Path, args) -> dict:
    """EPLB on against off while the hot experts move (tools/bench/vllm_drift.py), repeated."""
    from vllm_drift import CHAT_EXPERTS, CODE_EXPERTS, PHASES, PROMPT_TOKENS, summarize, verdict

    from eplb_graph.models.tiny_qwen3_moe import write_tiny_qwen3_moe

    batch = int(args.batch or 32)
    rounds = args.rounds or (4 if args.quick else 10)
    tokens = 16 if args.quick else 32
    model = write_tiny_qwen3_moe(
        root / "drift-model", dtype="bfloat16", domains=(CODE_EXPERTS, CHAT_EXPERTS),
        **DRIFT_SHAPE,
    )  # fmt: skip
    names = ["off", "on", *(["off_again"] if args.aa else [])]
    report = {
        "mode": "eager" if args.quick else "compiled",
        "shape": DRIFT_SHAPE,
        "domains": {"code": CODE_EXPERTS, "chat": CHAT_EXPERTS},
        "batch": batch,
        "rounds_per_phase": rounds,
        "decode_tokens": tokens,
        "phases": PHASES,
        "engines": names,
        "runs": [],
    }
    for repeat in range(args.repeat):
        metrics = {name: str(root / f"drift-{repeat}-{name}") for name in names}

        def engine(name: str, metrics=metrics) -> dict:
            never = name.startswith("off")
            section = {"metrics_path": metrics[name], "record_windows": not never}
            llm = engine_kwargs(
                eplb={
                    "eplb_config": {
                        "window_size": 10**6 if never else 32,
                        "step_interval": 10**6 if never else 64,
                        "num_redundant_experts": REDUNDANT,
                    },
                    "additional_config": {"eplb_graph": section},
                },
                eager=args.quick,
            )
            # Every prompt prefilled in one step: vLLM's CPU sampler cannot rewind the generator
            # of a seeded request whose prefill was chunked.
            prefill = batch * (PROMPT_TOKENS + 1)
            llm.update(dtype="bfloat16", max_num_seqs=batch, max_num_batched_tokens=prefill)
            return llm

        spec = {
            "kind": "drift",
            "model": str(model),
            "engines": {name: engine(name) for name in names},
            "metrics": metrics,
            "phases": list(PHASES),
            "rounds": rounds,
            "batch": batch,
            "tokens": tokens,
            "warmup_calls": 2,
            "seed": repeat,
        }
        raw = None if args.json is None else args.json.with_name(
            f"{args.json.stem}.run{repeat}.raw.json"
        )  # fmt: skip
        if args.resume and raw is not None and raw.exists():  # a repeat an earlier call ran
            result = json.loads(raw.read_text())
            print(f"  run {repeat}: reusing {raw}", flush=True)
        else:
            result = run_engine(root, f"drift-{repeat}", spec)
            windows = Path(metrics["on"]) / "windows.jsonl"
            result["windows_file"] = str(windows)
            result["replay"] = _replay(windows)
            if raw is not None:  # the raw rounds, kept whatever the summary makes of them
                raw.write_text(json.dumps(result))
        run = summarize(result, batch, tokens)
        run["windows_file"] = result.get("windows_file")
        run["replay"] = result.get("replay", {"error": "not recorded"})
        report["runs"].append(run)
        for phase, figures in run["phases"].items():
            first, adapted = figures["first"], figures["adapted"]
            print(
                f"  run {repeat} {phase:>7}: first {_ratio(first)}, adapted {_ratio(adapted)}; "
                f"windows to first move {figures['windows_to_first_move']}; moves "
                f"{[(m['action'], m['candidate'], m['copies']) for m in figures['moves']]}",
                flush=True,
            )
        print(
            f"  run {repeat} whole {_ratio(run['whole'])}; {run['rearrangements']} "
            f"rearrangements, {run['aborted']} aborted, {run['planning_failures']} failed "
            f"windows; moves repaid {run['moves_repaid']}/{run['moves_measured']}; replay "
            f"{run['replay']}",
            flush=True,
        )
    report["verdict"] = verdict(report["runs"])
    return report


def _ratio(segment: dict | None) -> str:
    if not segment:
        return "n/a"
    on, pairs = segment["on"], segment["on"]["pairs"]
    return f"{on['speedup']:.3f}x (95% {_fmt(pairs['low'])}-{_fmt(pairs['high'])})"


def _replay(path: Path) -> dict:
    """The recorded windows through a fresh gate: do its decisions equal the engine's?"""
    from eplb_graph.simulate.replay import replay_windows

    try:
        return replay_windows(path).summary()
    except (OSError, ValueError) as error:
        return {"error": str(error)}


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _benefit_verdict(report: dict) -> dict:
    """The goals of the benefit curve, judged on the ``on`` engines (vLLM's default).

    ``skewed_best`` / ``skewed_from_64_min``: over every skewed curve (``[curve, batch,
    ratio]``). ``below_goal``: every point under ``decode_ratio_min``, with the pairs' 95%
    interval and the rearrangements there; ``slower_beyond_noise``: those whose whole interval
    lies under it (on slower than the goal by more than the machine's noise at that point).
    """
    ratios, errors, skewed, skewed_from_64, below = [], [], [], [], []
    goals = report["goals"]
    for key, curve in report["curves"].items():
        for row in curve:
            on = row["on"]
            ratios.append((key, row["batch"], on["decode_speedup"]))
            if on["prediction_error"] is not None:
                errors.append((key, row["batch"], on["prediction_error"]))
            if key.endswith("/skewed"):
                skewed.append((key, row["batch"], on["decode_speedup"]))
                if row["batch"] >= 64:
                    skewed_from_64.append((key, row["batch"], on["decode_speedup"]))
            if on["decode_speedup"] < goals["decode_ratio_min"]:
                pairs = on["decode_speedup_pairs"]
                point = {
                    "curve": key,
                    "batch": row["batch"],
                    "ratio": on["decode_speedup"],
                    "pairs_low": pairs.get("low"),
                    "pairs_high": pairs.get("high"),
                    "rearrangements": on["rearrangements"],
                }
                if "off_again" in row:  # --aa: what two identical engines read at this point
                    control = row["off_again"]
                    point.update(
                        aa_ratio=control["decode_speedup"],
                        aa_low=control["decode_speedup_pairs"].get("low"),
                        aa_high=control["decode_speedup_pairs"].get("high"),
                    )
                below.append(point)
    always = [
        (key, row["batch"], row["always"]["decode_speedup"], row["always"]["rearrangements"])
        for key, curve in report["curves"].items()
        for row in curve
        if "always" in row
    ]
    return {
        "worst_decode_ratio": min(ratios, key=lambda r: r[2]) if ratios else None,
        "always_worst_decode_ratio": min(always, key=lambda r: r[2]) if always else None,
        "always_rearrangements": sum(r[3] for r in always) if always else None,
        "never_slower": not below,
        "below_goal": below,
        "slower_beyond_noise": [
            point
            for point in below
            if point["pairs_high"] is not None and point["pairs_high"] < goals["decode_ratio_min"]
        ],
        "skewed_best": max(skewed, key=lambda r: r[2], default=None),
        "skewed_from_64_min": min(skewed_from_64, key=lambda r: r[2], default=None),
        "largest_prediction_error": max(errors, key=lambda e: abs(e[2])) if errors else None,
        "prediction_within": all(abs(e[2]) <= goals["prediction_error_max"] for e in errors),
    }


def _curve_report(kind: str, title: str, measure, args) -> None:
    """Run ``--drift`` or ``--benefit`` in a scratch folder; print the verdict, plot, write."""
    import importlib

    with tempfile.TemporaryDirectory(prefix=f"bench-vllm-{kind}-") as folder:
        print(f"{kind}: {title}:")
        report = {"quick": args.quick, "loadavg_start": os.getloadavg()}
        report[kind] = measure(Path(folder), args)
        report["loadavg_end"] = os.getloadavg()
        print(f"  verdict: {json.dumps(report[kind]['verdict'])}")
        if args.plot is not None:
            plot = importlib.import_module(f"vllm_{kind}").plot
            if plot(report[kind], args.plot):
                print(f"  plot: {args.plot}")
        write_report(args.json, report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="eager engines, fewer steps")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument(
        "--batch", help="--benefit: concurrent sequences, comma-separated (default 8,24,64,256)"
    )
    parser.add_argument(
        "--shapes", default="wide,small", help="--benefit: which model shapes to run"
    )
    parser.add_argument(
        "--routers", default="skewed,uniform", help="--benefit: which routers to run"
    )
    parser.add_argument(
        "--calls",
        type=int,
        help="--benefit: timed calls per engine from 64 sequences up (default 4; "
        "up to 4x as many at smaller batches)",
    )
    parser.add_argument(
        "--always",
        action="store_true",
        help="--benefit: also an engine with rearrange=always (the behaviour before the model)",
    )
    parser.add_argument(
        "--aa",
        action="store_true",
        help="--benefit: also a second 'off' engine, an A/A control: the on / off ratio that "
        "two identical engines show at each point (the noise a ratio must beat)",
    )
    parser.add_argument(
        "--plot", type=Path, help="--benefit: write the curve as a PNG here (needs matplotlib)"
    )
    parser.add_argument(
        "--drift",
        action="store_true",
        help="EPLB on vs off while the hot experts move (code, chat, mixed, uniform traffic)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="--drift: repeated runs (default 1)")
    parser.add_argument("--rounds", type=int, help="--drift: rounds per phase (default 10)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="--drift: reuse the raw file of a repeat an earlier call wrote next to --json "
        "(NAME.run<k>.raw.json) instead of running it again",
    )
    parser.add_argument(
        "--benefit",
        action="store_true",
        help="EPLB on vs off on an experts-dominated, skewed model (and a uniform one)",
    )
    parser.add_argument("--engine", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine_main(*args.engine)
        return
    from eplb_graph.models.tiny_qwen3_moe import write_tiny_qwen3_moe

    if args.drift:
        _curve_report("drift", "EPLB on against off while the hot experts move", drift, args)
        return
    if args.benefit:
        _curve_report("benefit", "EPLB on against off, experts-dominated model", benefit, args)
        return
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as folder:
        root = Path(folder)
        model = write_tiny_qwen3_moe(root / "model")
        print("overhead, nothing pending (EPLB on against EPLB off):")
        report = {
            "environment": {
                "python": platform.python_version(),
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "loadavg_start": os.getloadavg(),
            },
            "quick": args.quick,
            "overhead": overhead(root, model, args),
        }
        o = report["overhead"]
        print(
            f"  ratio on/off {o['ratio_on_over_off']:.3f} (goal <= {OVERHEAD_GOAL}); "
            f"with 2 redundant slots {o['ratio_on_r2_over_off']:.3f}"
        )
        print("step time while a rearrangement is in flight:")
        report["in_flight"] = f = in_flight(root, model, args)
        print(
            f"  idle p50/p99 {f['idle_ms'].get('p50', 0):.2f}/{f['idle_ms'].get('p99', 0):.2f} ms"
            f" ({f['idle_ms']['count']} steps), in flight "
            f"{f['in_flight_ms'].get('p50', 0):.2f}/{f['in_flight_ms'].get('p99', 0):.2f} ms"
            f" ({f['in_flight_ms']['count']} steps); p99 ratio "
            f"{f['ratio_p99_in_flight_over_idle']} (goal <= {IN_FLIGHT_GOAL}); "
            f"{f['rearrangements']} rearrangements, {f['aborted']} aborted"
        )
        report["environment"]["loadavg_end"] = os.getloadavg()
        write_report(args.json, report)


if __name__ == "__main__":
    if "--engine" in sys.argv:
        main()
    else:
        run_benchmark(main)
