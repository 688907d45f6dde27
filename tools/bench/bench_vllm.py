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

``--benefit`` measures what EPLB gains instead (tools/bench/vllm_benefit.py): decode throughput,
TPOT, TTFT and the busiest rank's expert time with EPLB on against off, on a model whose experts
dominate a step, with a Zipf-skewed router and a uniform one.
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


def engine_main(spec_path: str, out_path: str) -> None:
    """Child process: the spec's engines, timed ``generate`` calls in turns (ABBA)."""
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("kind") == "benefit":
        from vllm_benefit import benefit_main

        benefit_main(spec, out_path)
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
            timeout=1800,
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
"""The EPLB-on engine applies a plan only if it cuts the busiest rank's load by 5%: later
windows of a steady load re-plan on noise, and each move costs a rank's only core."""
BENEFIT_GOALS = {"skewed_decode": 1.25, "uniform_decode": 0.98, "measured_over_predicted": 0.8}


def benefit(root: Path, args) -> dict:
    """EPLB on against off on an experts-dominated model, skewed and uniform routers."""
    from vllm_benefit import summarize

    from eplb_graph.models.tiny_qwen3_moe import write_tiny_qwen3_moe

    inter = args.intermediate or 512
    prompts = args.prompts or 256
    tokens, calls = (16, 2) if args.quick else (32, 6)
    report = {
        "shape": {
            "hidden": 1024, "layers": 4, "experts": 64, "top_k": 8, "moe_intermediate": inter,
            "dtype": "bfloat16", "redundant": 8, "prompts": prompts, "decode_tokens": tokens,
            "zipf_exponent": 1.2, "min_gain_percent_on": MIN_GAIN_PERCENT,
        },
        "mode": "eager" if args.quick else "compiled",
        "goals": BENEFIT_GOALS,
    }  # fmt: skip
    routers = {"skewed": 1.2, "uniform": 0.0}
    for router in args.routers.split(","):
        exponent = routers[router]
        model = write_tiny_qwen3_moe(
            root / f"benefit-{router}",
            hidden_size=1024,
            num_layers=4,
            num_experts=64,
            top_k=8,
            moe_intermediate_size=inter,
            router_zipf=exponent,
            hot_experts=(),
            dtype="bfloat16",
        )
        metrics = {name: str(root / f"benefit-{router}-{name}") for name in ("off", "on")}

        def engine(name: str, window: int, interval: int, gain: int, metrics=metrics) -> dict:
            llm = engine_kwargs(
                eplb={
                    "eplb_config": {
                        "window_size": window,
                        "step_interval": interval,
                        "num_redundant_experts": 8,
                    },
                    "additional_config": {
                        "eplb_graph": {"metrics_path": metrics[name], "min_gain_percent": gain}
                    },
                },
                eager=args.quick,
            )
            llm.update(
                dtype="bfloat16", max_num_seqs=prompts, max_num_batched_tokens=max(512, prompts)
            )
            return llm

        spec = {
            "kind": "benefit",
            "model": str(model),
            "engines": {
                "off": engine("off", 10**6, 10**6, 0),
                "on": engine("on", 32, 64, MIN_GAIN_PERCENT),
            },
            "metrics": metrics,
            "prompts": prompts,
            "tokens": tokens,
            "calls": calls,
            "max_warmup_calls": 12,
            "min_rearrangements": 1,
        }
        result = summarize(run_engine(root, f"benefit-{router}", spec), tokens, prompts)
        report[router] = result
        on, off = result["engines"]["on"], result["engines"]["off"]
        print(
            f"  {router}: decode {on['decode_tokens_per_s']:.1f} vs "
            f"{off['decode_tokens_per_s']:.1f} tok/s ({result['decode_speedup']:.3f}x), decode "
            f"step {on['decode_step_ms']:.1f} vs {off['decode_step_ms']:.1f} ms "
            f"({result['decode_step_speedup']:.3f}x); "
            f"busiest rank's expert ms "
            f"{max(on['expert_ms_per_rank']):.2f} vs {max(off['expert_ms_per_rank']):.2f} "
            f"(measured {result['expert_speedup_measured']}, counts predict "
            f"{result['expert_speedup_predicted_by_counts']}); balancedness measured "
            f"{on['balancedness_measured']} vs {off['balancedness_measured']}, counts "
            f"{on['balancedness_counts']} vs {off['balancedness_counts']}; "
            f"{on['rearrangements']} rearrangements"
        )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="eager engines, fewer steps")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument(
        "--prompts", type=int, help="--benefit: concurrent sequences (the decode batch)"
    )
    parser.add_argument(
        "--intermediate", type=int, help="--benefit: the experts' intermediate size"
    )
    parser.add_argument(
        "--routers", default="skewed,uniform", help="--benefit: which routers to run"
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

    if args.benefit:
        with tempfile.TemporaryDirectory(prefix="bench-vllm-benefit-") as folder:
            print("benefit: EPLB on against off, experts-dominated model:")
            report = {"quick": args.quick, "loadavg_start": os.getloadavg()}
            report["benefit"] = benefit(Path(folder), args)
            report["loadavg_end"] = os.getloadavg()
            write_report(args.json, report)
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
