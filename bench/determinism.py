"""Deterministic mode against default mode on the default model (issue 30), in one run.

Mismatches: greedy requests with logprobs (prompts of 40 to 2,300 tokens, half sharing an
800-token system prompt) run alone, then together in shuffled order with chunk budgets 64, 512
and 2048, each followed by a run with their prompts in the prefix cache; each request's tokens
and logprobs are compared bitwise with its alone run, in each mode (6 comparisons a prompt: the
default 34 prompts make 204). Cost: decode throughput at 1 and 32 streams
and the cold prefill of a 2,300-token prompt, each mode in the same run (the median of
`--rounds` rounds, the two modes taking turns).

    .venv/bin/python bench/determinism.py [--dtype bfloat16] [--prompts 34] [--rounds 3]

Run it with nothing else busy on the machine. The last line is JSON, also written to
bench/results/determinism.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine import RESULTS_DIR, write_json
from inference.engine import LLM, SamplingParams

NEW_TOKENS = 24


def prompts_for(vocab: int, count: int) -> list[list[int]]:
    rng = random.Random(30)
    system = [rng.randrange(100, vocab) for _ in range(800)]
    lengths = [40 + (2300 - 40) * i // max(count - 1, 1) for i in range(count)]
    return [
        (system + [rng.randrange(100, vocab) for _ in range(max(n - 800, 8))])
        if i % 2
        else [rng.randrange(100, vocab) for _ in range(n)]
        for i, n in enumerate(lengths)
    ]


def answers(results) -> list[tuple]:
    return [(tuple(r.token_ids), tuple(lp.logprob for lp in r.logprobs)) for r in results]


def mismatches(dtype: str, deterministic: bool, prompts) -> tuple[int, int]:
    """(requests whose answer differs from their alone run, comparisons made)."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
    alone_llm = LLM(dtype=dtype, deterministic=deterministic, enable_prefix_caching=False)
    alone = answers([alone_llm.generate([p], params)[0] for p in prompts])
    del alone_llm
    differ = compared = 0
    for budget in (64, 512, 2048):
        llm = LLM(dtype=dtype, deterministic=deterministic, max_num_batched_tokens=budget)
        order = list(range(len(prompts)))
        random.Random(budget).shuffle(order)
        got = answers(llm.generate([prompts[i] for i in order], params))
        runs = [{i: a for i, a in zip(order, got, strict=True)}]
        runs.append(dict(enumerate(answers(llm.generate(prompts, params)))))  # warm cache
        for run in runs:
            for index, want in enumerate(alone):
                compared += 1
                differ += run[index] != want
    return differ, compared


def throughput(dtype: str, vocab: int, rounds: int) -> dict[str, dict[str, float]]:
    """Decode tok/s at 1 and 32 streams and a 2,300-token cold prefill's seconds, for each mode:
    the median of `rounds` rounds, the two modes' engines taking turns within each round."""
    engines = {
        mode: LLM(dtype=dtype, deterministic=deterministic, enable_prefix_caching=False)
        for mode, deterministic in (("default", False), ("deterministic", True))
    }
    rng = random.Random(1)
    batches = {
        streams: [[rng.randrange(100, vocab) for _ in range(64)] for _ in range(streams)]
        for streams in (1, 32)
    }
    prompt = [rng.randrange(100, vocab) for _ in range(2300)]
    decode = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    samples = {mode: {"c1": [], "c32": [], "prefill": []} for mode in engines}
    for llm in engines.values():
        llm.generate(batches[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    for _ in range(rounds):
        for mode, llm in engines.items():
            for streams in (1, 32):
                start = time.perf_counter()
                results = llm.generate(batches[streams], decode)
                elapsed = time.perf_counter() - start
                tokens = sum(len(r.token_ids) for r in results)
                samples[mode][f"c{streams}"].append(tokens / elapsed)
            start = time.perf_counter()
            llm.generate([prompt], one_token)
            samples[mode]["prefill"].append(time.perf_counter() - start)
    return {
        mode: {name: statistics.median(values) for name, values in figures.items()}
        for mode, figures in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=34)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "determinism.json")
    args = parser.parse_args()
    vocab = LLM(dtype=args.dtype).tokenizer.vocab_size
    prompts = prompts_for(vocab, args.prompts)
    result = {"dtype": args.dtype}
    for mode, deterministic in (("default", False), ("deterministic", True)):
        differ, compared = mismatches(args.dtype, deterministic, prompts)
        result[f"{mode}_mismatches"] = differ
        result["comparisons"] = compared
        print(f"{mode}: {differ} of {compared} answers differ from the request alone", flush=True)
    for mode, figures in throughput(args.dtype, vocab, args.rounds).items():
        result[f"c1_tok_s_{mode}"] = round(figures["c1"], 2)
        result[f"c32_tok_s_{mode}"] = round(figures["c32"], 2)
        result[f"prefill_s_{mode}"] = round(figures["prefill"], 3)
        print(f"{mode}: {figures}", flush=True)
    for key in ("c1_tok_s", "c32_tok_s"):
        ratio = result[f"{key}_deterministic"] / result[f"{key}_default"]
        print(f"{key}: deterministic / default = {ratio:.2f} (target >= 0.8)")
    ratio = result["prefill_s_deterministic"] / result["prefill_s_default"]
    print(f"prefill: deterministic / default = {ratio:.2f} (target <= 1.25)")
    write_json(result, args.output)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
