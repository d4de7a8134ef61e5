"""Cost of grammar-constrained decoding: tokens/s with and without a JSON schema.

SmolLM2-135M-Instruct (bf16, CPU), 16 chat requests submitted at once, greedy. The constrained
run asks each for JSON valid against SCHEMA (a list of records, long enough that no request
finishes before its token budget); the baseline runs the same prompts, unconstrained, with
`ignore_eos` and each request's token budget set to the number of tokens its constrained twin
produced, so both runs compute exactly the same number of tokens per request. Each figure is
the best of `--repeats` alternating runs (the machine is shared). Target: constrained ≥ 85% of
unconstrained.

    .venv/bin/python bench/structured.py              # prints a table, then one JSON line
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import jsonschema  # noqa: E402

from inference.engine import LLM, SamplingParams  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
CONCURRENCY = 16
TARGET_RATIO = 0.85
SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 12,
            "maxItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "city": {"enum": ["Paris", "London", "Tokyo", "Lima"]},
                },
                "required": ["name", "age", "city"],
            },
        }
    },
    "required": ["people"],
}
TOPICS = [
    "a football team", "a chess club", "a research lab", "a film crew", "a choir",
    "a kitchen brigade", "a startup", "an orchestra", "a hiking group", "a book club",
    "a rowing crew", "a newsroom", "a school class", "a jazz band", "a ship's crew", "a council",
]  # fmt: skip


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prompts(llm: LLM) -> list[list[int]]:
    tokenizer = llm.engine.tokenizer
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"List the members of {topic} as JSON."}]
        )
        for topic in TOPICS[:CONCURRENCY]
    ]


def run(llm: LLM, token_lists, params) -> tuple[list, float]:
    start = time.perf_counter()
    outputs = llm.generate(token_lists, params, namespace=f"run-{time.perf_counter_ns()}")
    return outputs, time.perf_counter() - start


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    result = measure(args.max_tokens, args.repeats)
    print(f"{'run':<14} {'tok/s':>8} {'tokens':>7}")
    print(f"{'unconstrained':<14} {result['unconstrained_tok_s']:>8.1f} {result['tokens']:>7}")
    print(f"{'constrained':<14} {result['constrained_tok_s']:>8.1f} {result['tokens']:>7}")
    met = result["constrained_ratio"] >= TARGET_RATIO
    print(f"ratio {result['constrained_ratio']:.3f} (target >= {TARGET_RATIO}: {met})")
    (REPO_ROOT / "bench" / "results").mkdir(exist_ok=True)
    (REPO_ROOT / "bench" / "results" / "structured.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return result


def measure(max_tokens: int = 96, repeats: int = 2) -> dict:
    """Best-of-`repeats` tokens/s of both runs; see the module docstring."""
    log(f"loading {MODEL}")
    llm = LLM(MODEL)
    token_lists = prompts(llm)
    spec = {"type": "json_schema", "schema": SCHEMA, "strict": True}
    constrained = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=spec)
    run(llm, token_lists[:2], constrained)  # warm-up: the grammar compiles once, then is cached
    best_constrained = best_free = 0.0
    for attempt in range(repeats):
        outputs, seconds = run(llm, token_lists, constrained)
        lengths = [len(o.token_ids) for o in outputs]
        for out in outputs:  # the prefix of a valid document, or the whole of one
            if out.finish_reason == "stop":
                jsonschema.validate(json.loads(out.text), SCHEMA)
        tokens = sum(lengths)
        best_constrained = max(best_constrained, tokens / seconds)
        free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        free_outputs, free_seconds = run(llm, token_lists, free)
        assert sum(len(o.token_ids) for o in free_outputs) == tokens
        best_free = max(best_free, tokens / free_seconds)
        log(f"run {attempt + 1}: constrained {tokens / seconds:.1f} tok/s, "
            f"unconstrained {tokens / free_seconds:.1f} tok/s ({tokens} tokens)")  # fmt: skip
    return {
        "concurrency": CONCURRENCY,
        "tokens": tokens,
        "constrained_tok_s": round(best_constrained, 1),
        "unconstrained_tok_s": round(best_free, 1),
        "constrained_ratio": round(best_constrained / best_free, 3),
    }


if __name__ == "__main__":
    main()
