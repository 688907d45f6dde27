"""Run one real vLLM engine scenario in a fresh process and write what the tests assert on.

``python tests/vllm_scenario.py SPEC.json OUT.json``. SPEC names the model folder, the prompts
and either the ``LLM`` keyword arguments (``"llm"``) or a code block to run (``"snippet"``, e.g.
the offline example of docs/vllm.md, run with ``MODEL``, ``PROMPTS`` and ``METRICS`` defined and
expected to leave ``outputs`` behind). OUT receives the greedy tokens and the engine start time;
the engine's workers write the metrics files themselves.

SPEC may instead hold ``"engines"``: a list of such specs (each with a ``"name"``), started one
after another in this one process (each shut down before the next starts), saving a process
start and vLLM's import per engine; OUT then maps each name to its tokens, or to the error that
engine raised (the next still runs).

A separate process per engine (or group of engines) keeps vLLM's process-wide state (its
plugins, environment and spawned workers) out of the test process, and lets the test kill a hung
engine. vLLM's CPU workers are spawned processes that import this module: everything runs under
the main guard.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as handle:
        spec = json.load(handle)
    if "engines" in spec:
        results = {}
        for engine in spec["engines"]:
            try:
                results[engine["name"]] = run(engine, shut_down=True)
            except Exception as error:  # reported per engine; the test names it
                results[engine["name"]] = {"error": f"{type(error).__name__}: {error}"}
    else:
        results = run(spec)
    with open(out_path, "w") as handle:
        json.dump(results, handle)


def run(spec: dict, shut_down: bool = False) -> dict:
    """One engine: start it, generate greedily (and shut it down); its tokens and start time."""
    os.environ.update(spec.get("env", {}))  # read by the engine processes it spawns
    prompts = [{"prompt_token_ids": prompt} for prompt in spec["prompts"]]
    started = time.perf_counter()
    if "snippet" in spec:
        namespace = {"MODEL": spec["model"], "PROMPTS": prompts, "METRICS": spec["metrics"]}
        exec(compile(spec["snippet"], "docs/vllm.md", "exec"), namespace)
        rounds = [[list(output.outputs[0].token_ids) for output in namespace["outputs"]]]
        engine_seconds = None
    else:
        from vllm import LLM, SamplingParams

        llm = LLM(model=spec["model"], **spec["llm"])
        engine_seconds = time.perf_counter() - started
        sampling = SamplingParams(
            max_tokens=spec["max_tokens"], temperature=0, detokenize=False, ignore_eos=True
        )
        rounds = []
        for _ in range(spec.get("rounds", 1)):
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
            rounds.append([list(output.outputs[0].token_ids) for output in outputs])
        if shut_down:  # its workers gone before the next engine of this process starts
            llm.llm_engine.engine_core.shutdown()
        del llm
    return {"tokens": rounds, "engine_seconds": engine_seconds}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
