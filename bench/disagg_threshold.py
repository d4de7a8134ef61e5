"""Where splitting starts to pay: how long a decode node's step stalls its decoding requests when
it also prefills N uncached prompt tokens, against what moving N tokens' KV costs.

On one thread (a node of the disaggregation benchmark), SmolLM2-135M-Instruct: a decode batch of
`--decoders` requests, each step alone (the baseline, measured in the same run) and with a
prefill of N tokens beside it (one chunk, as the scheduler runs it); the stall is the difference.
And the KV of N tokens written with the Transfer Engine between two caches in this process. The
threshold HEARTH_DISAGG_MIN_TOKENS should be about the N whose stall passes the decode latency
objective (`--tpot-slo-ms`): below it, prefilling locally costs the decoders less than the
objective; above, the split keeps them within it (docs/disaggregation.md).

    .venv/bin/python bench/disagg_threshold.py
    .venv/bin/python bench/disagg_threshold.py --dtype bfloat16 --decoders 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from inference.disagg.layout import kv_layout_of  # noqa: E402
from inference.disagg.transfer import KVTransfer  # noqa: E402
from inference.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

SIZES = (0, 64, 128, 256, 512, 1024, 2048)


def step_ms(engine: LLMEngine, decoders: int, prefill_tokens: int, repeats: int) -> float:
    """The median time of a step running `decoders` decodes and a prefill of that many tokens."""
    times = []
    for repeat in range(repeats):
        ids = [f"d{repeat}-{i}" for i in range(decoders)]
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        for index, request_id in enumerate(ids):
            engine.add_request(request_id, [200 + index + repeat * 50] * 20, params)
        engine.step()  # their prompts
        engine.step()  # decoding now
        if prefill_tokens:
            prompt = [(1000 + repeat * 7 + i) % 40000 + 100 for i in range(prefill_tokens + 1)]
            engine.add_request(f"p{repeat}", prompt, SamplingParams(max_tokens=1))
        started = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - started) * 1000)
        for request_id in [*ids, f"p{repeat}"]:
            engine.abort(request_id)
        engine.step()
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tpot-slo-ms", type=float, default=100.0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    def engine(blocks: int = 512) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=args.model,
                dtype=args.dtype,
                num_kv_blocks=blocks,
                max_num_batched_tokens=4096,
                enable_prefix_caching=False,
            )
        )

    decode, peer = engine(), engine()
    ours = KVTransfer(decode.runner.kv_buffer, kv_layout_of(decode, "bench"))
    theirs = KVTransfer(peer.runner.kv_buffer, kv_layout_of(peer, "bench"))
    step_ms(decode, args.decoders, 0, 1)  # warm up
    rows = []
    baseline = step_ms(decode, args.decoders, 0, args.repeats)
    for size in SIZES:
        step = baseline if size == 0 else step_ms(decode, args.decoders, size, args.repeats)
        blocks = size // decode.config.block_size
        transfer = []
        for _ in range(args.repeats if blocks else 0):
            written = ours.write_blocks(theirs.region, list(range(blocks)), list(range(blocks)))
            transfer.append(written.seconds * 1000)
        rows.append(
            {
                "prefill_tokens": size,
                "step_ms": round(step, 2),
                "stall_ms": round(step - baseline, 2),
                "transfer_ms": round(statistics.median(transfer), 2) if transfer else 0.0,
            }
        )
    print(
        f"{args.model} {args.dtype}, one thread, a decode batch of {args.decoders}; "
        f"decode-only step (baseline, same run): {baseline:.1f} ms"
    )
    print(f"{'prefill tokens':>15} {'step ms':>9} {'stall ms':>9} {'KV write ms':>12}")
    for row in rows:
        print(
            f"{row['prefill_tokens']:>15} {row['step_ms']:>9.1f} {row['stall_ms']:>9.1f} "
            f"{row['transfer_ms']:>12.2f}"
        )
    over = [r["prefill_tokens"] for r in rows if r["stall_ms"] > args.tpot_slo_ms]
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "decoders": args.decoders,
        "decode_step_ms": round(baseline, 2),
        "rows": rows,
        "tpot_slo_ms": args.tpot_slo_ms,
        "first_size_over_slo": over[0] if over else None,
    }
    out = REPO_ROOT / "bench" / "results" / "disagg_threshold.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
