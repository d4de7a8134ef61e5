"""Command line: `python -m inference.cli chat "question"` answers with the default model."""

from __future__ import annotations

import argparse
import sys
import time

from inference.engine import LLM, InvalidRequestError, ModelLoadError, SamplingParams
from inference.models.loader import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference.cli")
    commands = parser.add_subparsers(dest="command", required=True)
    chat = commands.add_parser("chat", help="answer one chat message")
    chat.add_argument("message")
    chat.add_argument("--model", default=DEFAULT_MODEL)
    chat.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)

    started = time.time()
    try:
        llm = LLM(args.model, dtype=args.dtype)
        loaded = time.time()
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        )
        [result] = llm.chat([{"role": "user", "content": args.message}], params)
    except (ModelLoadError, InvalidRequestError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(result.text)
    timings = result.timings
    print(
        f"[{args.model}, {llm.engine.config.dtype}: loaded in {loaded - started:.1f}s, "
        f"{result.prompt_tokens} prompt + {result.completion_tokens} completion tokens, "
        f"first token {timings.ttft_s:.3f}s, finish_reason={result.finish_reason}]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
