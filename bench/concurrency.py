"""The engine benchmark's concurrency curve and its busy-core phase (bench/engine.py).

- The curve: for each size, that many chat prompts submitted at once, greedy, the same number
  of new tokens each: generated tokens per wall-clock second, and each request's time per output
  token (TPOT, `Timings.tpot_s`) at the 50th and 99th percentiles; HF `generate` (float32) runs
  the same prompts as one left-padded batch at each size up to `hf_max`.
- Busy: a process that spins on one core (as a test suite or the control plane beside the node
  would) runs while a phase is measured (`busy_core`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import statistics
from collections.abc import Iterator
from typing import Any

from inference.engine import LLM
from inference.engine.tokenizer import Tokenizer

CURVE_SIZES = (1, 4, 16, 32, 64, 128)


def curve_prompts(tokenizer: Tokenizer, questions: tuple[str, ...], count: int) -> list[list[int]]:
    """`count` single-turn chats: the questions in order, then again with a numbered request
    for another answer, so that no two prompts are the same."""
    prompts = []
    for index in range(count):
        question = questions[index % len(questions)]
        if index >= len(questions):
            question += f" Give answer number {index // len(questions) + 1}."
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": question}]))
    return prompts


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))]


def engine_curve(
    llm: LLM, prompts: list[list[int]], new_tokens: int, generate, sizes=CURVE_SIZES
) -> list[dict[str, Any]]:
    """The engine's curve: tokens per second and TPOT p50/p99 at each size (`generate`:
    bench.engine's `engine_outputs`, which returns the finished requests and the wall time)."""
    points = []
    for size in sizes:
        outputs, seconds = generate(llm, prompts[:size], new_tokens, f"curve-{size}")
        tpots = [o.timings.tpot_s for o in outputs if o.timings.tpot_s is not None]
        points.append(
            {
                "concurrency": size,
                "tok_s": sum(len(o.token_ids) for o in outputs) / seconds,
                "tpot_p50_s": statistics.median(tpots),
                "tpot_p99_s": percentile(tpots, 0.99),
            }
        )
    return points


def hf_curve(
    model: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int, generate, hf_max: int
) -> list[dict[str, Any]]:
    """HF's batched throughput at each size up to `hf_max` (`generate`: bench.engine's
    `hf_generate`); a static batch's TPOT is its step time, the same for every request."""
    points = []
    for size in (s for s in CURVE_SIZES if s <= hf_max):
        throughput, _ = generate(model, tokenizer, prompts[:size], new_tokens)
        points.append(
            {
                "concurrency": size,
                "tok_s": throughput.tok_s,
                "tpot_s": throughput.seconds / new_tokens,
            }
        )
    return points


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    """One core kept busy by another process for the duration."""
    process = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
    process.start()
    try:
        yield
    finally:
        process.terminate()
        process.join()
