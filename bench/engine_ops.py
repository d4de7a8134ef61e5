"""Where a decode step's time goes, op by op: the engine's default configuration on
SmolLM2-135M-Instruct, decoding `--concurrency` sequences (1 and 32 by default), profiled with
torch.profiler over `--steps` decode steps after a warm-up.

For each concurrency it prints the step's wall time, the time inside torch ops (their self CPU
time, summed over threads' launches from the step's thread: what the step waits for) and the rest
(Python, the scheduler, the sampler's bookkeeping), then the ops that take the most, with their
calls per step; as its last line one JSON object, also written to bench/results/engine-ops.json.

    .venv/bin/python bench/engine_ops.py
    .venv/bin/python bench/engine_ops.py --concurrency 1 --steps 20
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.concurrency import curve_prompts  # noqa: E402
from bench.engine import MODEL, QUESTIONS, RESULTS_DIR, greedy, log, write_json  # noqa: E402
from inference.engine import LLM  # noqa: E402

TOP = 15


def decode_steps(llm: LLM, prompts: list[list[int]], steps: int, tag: str) -> tuple[float, Any]:
    """Admit `prompts`, run until every one is decoding, then profile `steps` steps; (wall
    seconds per step, the profiler)."""
    engine = llm.engine
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", prompt, greedy(steps + 8), namespace=tag)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        seconds = (time.perf_counter() - start) / steps
    while engine.has_unfinished_requests():
        engine.step()
    return seconds, profiler


def op_table(profiler: Any, steps: int) -> list[dict[str, Any]]:
    """Ops by self CPU time per step, largest first (torch's own aten ops only)."""
    rows = []
    for event in profiler.key_averages():
        if not event.key.startswith("aten::"):
            continue
        rows.append(
            {
                "op": event.key,
                "ms_per_step": event.self_cpu_time_total / 1000 / steps,
                "calls_per_step": event.count / steps,
            }
        )
    return sorted(rows, key=lambda row: row["ms_per_step"], reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "engine-ops.json")
    args = parser.parse_args()
    llm = LLM(MODEL)
    prompts = curve_prompts(llm.tokenizer, QUESTIONS, max(args.concurrency))
    decode_steps(llm, prompts[:2], 4, "warmup")
    result: dict[str, Any] = {"model": MODEL, "dtype": llm.engine.config.dtype, "runs": []}
    for size in args.concurrency:
        seconds, profiler = decode_steps(llm, prompts[:size], args.steps, f"c{size}")
        ops = op_table(profiler, args.steps)
        in_ops = sum(row["ms_per_step"] for row in ops)
        step_ms = seconds * 1000
        log(f"c{size}: {step_ms:.2f} ms a step")
        print(
            f"\nconcurrency {size}: {step_ms:.2f} ms a decode step (wall), threads "
            f"{torch.get_num_threads()}"
        )
        print(f"  in torch ops {in_ops:.2f} ms; outside them {step_ms - in_ops:.2f} ms")
        print(f"  {'op':<40} {'ms/step':>8} {'share':>6} {'calls/step':>10}")
        for row in ops[:TOP]:
            share = row["ms_per_step"] / step_ms
            print(
                f"  {row['op']:<40} {row['ms_per_step']:>8.3f} {share:>6.1%} "
                f"{row['calls_per_step']:>10.1f}"
            )
        result["runs"].append(
            {
                "concurrency": size,
                "step_ms": step_ms,
                "in_ops_ms": in_ops,
                "outside_ops_ms": step_ms - in_ops,
                "threads": torch.get_num_threads(),
                "ops": ops[:40],
            }
        )
    write_json(result, args.output)
    print(json.dumps({f"c{run['concurrency']}_step_ms": run["step_ms"] for run in result["runs"]}))


if __name__ == "__main__":
    main()
