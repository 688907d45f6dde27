"""Run one real vLLM engine scenario in a fresh process and write what the tests assert on.

``python tests/vllm_scenario.py SPEC.json OUT.json``: SPEC holds the model folder, the ``LLM``
keyword arguments, the prompts and the number of generate rounds. OUT receives the greedy tokens
of every round and how long the engine took to start. The metrics files (if the spec asks for
them) are written by the engine's workers themselves.

A separate process per engine keeps vLLM's process-wide state (its plugins, environment and
spawned workers) out of the test process, and lets the test kill a hung engine.
"""

from __future__ import annotations

import json
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as handle:
        spec = json.load(handle)
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=spec["model"], **spec["llm"])
    engine_seconds = time.perf_counter() - started
    sampling = SamplingParams(
        max_tokens=spec["max_tokens"], temperature=0, detokenize=False, ignore_eos=True
    )
    prompts = [{"prompt_token_ids": prompt} for prompt in spec["prompts"]]
    rounds = []
    for _ in range(spec.get("rounds", 1)):
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        rounds.append([list(output.outputs[0].token_ids) for output in outputs])
    with open(out_path, "w") as handle:
        json.dump({"tokens": rounds, "engine_seconds": engine_seconds}, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
