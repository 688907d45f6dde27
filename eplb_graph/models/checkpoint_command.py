"""``eplb-graph checkpoint OUT``: write a small MoE checkpoint to try eplb-graph under vLLM.

A new user has no MoE model at hand (and often no hub access); this writes the tiny seeded
checkpoint the tests serve, with a chosen router skew, so the docs' server command has a model.
"""

from __future__ import annotations

import argparse
import sys

from eplb_graph.models.tiny_qwen3_moe import write_tiny_qwen3_moe

FAMILIES = ("qwen3_moe",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", metavar="OUT", help="folder to write (config.json + weights)")
    parser.add_argument(
        "--family", choices=FAMILIES, default="qwen3_moe", help="model family (default: qwen3_moe)"
    )
    parser.add_argument(
        "--zipf",
        type=float,
        default=None,
        metavar="S",
        help="router skew: the expert ranked r (2, 3, 4 first) gets gate scale (r+1)^-S, "
        "normalised to mean 1 (0: none; without it experts 2, 3 and 4 are hot and the rest "
        "cold, the tests' worst case for the default placement)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    parser.set_defaults(handler=run)


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "checkpoint",
        help="write a tiny MoE checkpoint (Qwen3-MoE, 2 layers, 8 experts) for trying vLLM",
        description="Write a tiny seeded MoE checkpoint (random weights, no tokenizer: prompts "
        "are token ids) that vLLM's CPU backend serves in seconds. Needs transformers (the vllm "
        "extra).",
    )
    add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.zipf is not None and args.zipf < 0:
        sys.stderr.write(f"eplb-graph checkpoint: --zipf must be >= 0, got {args.zipf}\n")
        return 2
    try:
        path = write_tiny_qwen3_moe(args.out, seed=args.seed, router_zipf=args.zipf)
    except ImportError as error:
        sys.stderr.write(
            f"eplb-graph checkpoint: needs transformers ({error}): install the vllm extra\n"
        )
        return 2
    except OSError as error:
        sys.stderr.write(f"eplb-graph checkpoint: cannot write {args.out}: {error}\n")
        return 2
    sys.stdout.write(f"wrote a tiny {args.family} checkpoint to {path}\n")
    return 0
