"""Tensor-parallel benchmark: one model served by one rank and by a group of two ranks.

Builds, in the run, a random-weight Llama (transformers' `LlamaConfig`, seeded, saved as a Hugging
Face directory in a temporary directory with a word-level tokenizer; nothing is downloaded) and
serves it with the engine in float32, first with `tensor_parallel=1`, then with 2 (rank 0 and
one follower process on gloo, each with half the machine's cores: the same cores in all). Each
world size runs in a fresh process, so that its peak memory is its own. Measured, after a
warm-up request:

- `tp1_tok_s` / `tp2_tok_s`: generated tokens per wall-clock second (prefill included) for
  `--concurrency` prompts of `--prompt-tokens` submitted at once, `--new-tokens` each; and
  `tp*_c1_tok_s` for one prompt alone (decode steps of one row: the collectives' fixed cost
  against the least compute);
- per-rank peak RSS (`VmHWM` of each rank's process; `tp2_rank_peak_rss_mb` is the larger),
  and the same for a process that imports the engine and loads the tokenizer but no model
  (`base_rss_mb`): the difference is the weights' part (plus the KV cache and activations),
  which tensor parallelism should halve (target: tp2's at most 0.6 of tp1's);
- the time rank 0 spends in collectives per step, timed around torch.distributed's calls in
  rank 0's process: the model's all-reduces and all-gathers (waiting for the slower rank
  included) and the step broadcast to the follower, against the step's wall time
  (`comm_share_tp2`, for the batch; `comm_share_tp2_c1` alone);
- `greedy_mismatches`: requests whose greedy tokens differ between the world sizes (target 0).

Then the same requests on a random-weight Mixtral (8 experts, 2 a token) served three ways: one
rank (`moe_tp1_tok_s`), two ranks with tensor-parallel attention and the experts spread
(`moe_ep2_tok_s`: each rank runs its experts on every token, one all-reduce combines them), and two
ranks with data-parallel attention (`moe_dp2_tok_s`: each rank runs its own sequences, and tokens
reach the other rank's experts by all-to-all), with rank 0's time in all-to-all and all-reduce
against the step (`comm_share_dp2`, `comm_share_ep2`) and `moe_greedy_mismatches` over both.

It prints the model, a table (metric, tp1, tp2, ratio, target, met), rank 0's time per step by
collective and, as the last line of stdout, one JSON object, also written to
bench/results/parallel.json (parallel-smoke.json with `--config smoke`; `--out` for another
path). Progress goes to stderr.

    .venv/bin/python bench/parallel.py                  # hidden 512, 8 layers (about a minute)
    .venv/bin/python bench/parallel.py --config smoke   # tiny model, a few seconds a side
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

# `python bench/parallel.py` puts bench/ on sys.path, not the repository root.
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.engine import cpu_count, fmt, greedy, log, write_json  # noqa: E402

RESULTS_DIR = REPO_ROOT / "bench" / "results"
EOS_TOKEN = 0
FIRST_ORDINARY_TOKEN = 2  # after <eos> and <unk>
# The torch.distributed calls timed in rank 0, and the label each is counted under.
COLLECTIVES = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_to_all_single": "all_to_all",
    "reduce_scatter_tensor": "reduce_scatter",
    "broadcast": "step_broadcast",  # the model never broadcasts; the step protocol does
}
RSS_WEIGHTS_TARGET = 0.6


@dataclass(frozen=True)
class RunConfig:
    """A Llama shape (LlamaConfig keywords) and the measurement's sizes."""

    model: dict[str, Any]
    moe_model: dict[str, Any]  # MixtralConfig keywords
    concurrency: int
    prompt_tokens: int
    new_tokens: int


CONFIGS = {
    "small": RunConfig(
        model=dict(
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
        ),
        moe_model=dict(
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
        concurrency=8,
        prompt_tokens=128,
        new_tokens=32,
    ),
    "smoke": RunConfig(
        model=dict(
            vocab_size=2048,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        moe_model=dict(
            vocab_size=2048,
            hidden_size=128,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        concurrency=4,
        prompt_tokens=32,
        new_tokens=8,
    ),
}


# ---- the model ------------------------------------------------------------------------------
def build_model(directory: Path, shape: dict[str, Any], seed: int, moe: bool = False) -> int:
    """Save a random-weight float32 Llama (`moe`: Mixtral) of `shape` with a word-level
    tokenizer covering its vocabulary; return its parameter count. Weights drawn wider than the
    default (0.05) so that greedy choices are not near ties that summation order could flip."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        MixtralConfig,
        PreTrainedTokenizerFast,
    )

    vocab = {"<eos>": EOS_TOKEN, "<unk>": 1}
    vocab.update({f"w{i}": i for i in range(FIRST_ORDINARY_TOKEN, shape["vocab_size"])})
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>"
    ).save_pretrained(str(directory))
    config = (MixtralConfig if moe else LlamaConfig)(
        **shape,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=EOS_TOKEN,
        eos_token_id=EOS_TOKEN,
        pad_token_id=EOS_TOKEN,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(directory))
    return sum(p.numel() for p in model.parameters())


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(length)]
        for _ in range(count)
    ]


# ---- one world size, in its own process ---------------------------------------------------------
class CollectiveClock:
    """Seconds spent in each torch.distributed collective of this process, by label."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def install(self) -> None:
        import torch.distributed as dist

        for name, label in COLLECTIVES.items():
            setattr(dist, name, self._timed(getattr(dist, name), label))

    def _timed(self, function, label: str):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start

        return timed

    def reset(self) -> None:
        self.seconds.clear()


def peak_rss_mb(pid: int | str = "self") -> float:
    """A process's peak resident set (VmHWM), in MiB: this one's, or `pid`'s. Not getrusage's
    ru_maxrss, which a process inherits across fork and exec from its parent (this bench's
    parent holds the whole model it built)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def serve(engine, prompts: list[list[int]], new_tokens: int, clock: CollectiveClock, tag: str):
    """Run `prompts` to completion, step by step; (tokens per request, wall seconds, steps,
    seconds in collectives by label)."""
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", prompt, greedy(new_tokens), namespace=tag)
    tokens: dict[str, list[int]] = {f"{tag}-{index}": [] for index in range(len(prompts))}
    clock.reset()
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.token_ids)
        steps += 1
    seconds = time.perf_counter() - start
    return list(tokens.values()), seconds, steps, dict(clock.seconds)


# How a group of two holds the model: tensor parallelism; experts spread with tensor-parallel
# attention; experts spread with data-parallel attention.
LAYOUTS = {
    "tp": {},
    "ep": {"expert_parallel": 2},
    "dp": {"expert_parallel": 2, "data_parallel_attention": True},
}


def measure(
    directory: Path, world: int, run: RunConfig, seed: int, layout: str = "tp"
) -> dict[str, Any]:
    """One world size's figures (world 0: the base process, no model), the group laid out as
    `LAYOUTS[layout]`."""
    from inference.engine import LLM
    from inference.engine.tokenizer import Tokenizer

    if world == 0:
        Tokenizer(directory)
        return {"world": 0, "rank_peak_rss_mb": [peak_rss_mb()]}
    if world == 1:
        torch.set_num_threads(cpu_count())
    prompts = random_prompts(run.concurrency, run.prompt_tokens, run.model["vocab_size"], seed)
    blocks = run.concurrency * -(-(run.prompt_tokens + run.new_tokens) // 16) + 16
    options = LAYOUTS[layout] if world > 1 else {}
    llm = LLM(
        str(directory), dtype="float32", tensor_parallel=world, num_kv_blocks=blocks, **options
    )
    engine = llm.engine
    try:
        clock = CollectiveClock()
        clock.install()
        serve(engine, prompts[:1], 4, clock, "warmup")
        batch, batch_s, batch_steps, batch_comm = serve(
            engine, prompts, run.new_tokens, clock, "batch"
        )
        [alone], alone_s, alone_steps, alone_comm = serve(
            engine, prompts[:1], run.new_tokens, clock, "alone"
        )
        rss = [peak_rss_mb()]
        if engine.group is not None:
            rss += [peak_rss_mb(pid) for pid in engine.group.pids]
    finally:
        engine.close()
    return {
        "world": world,
        "tok_s": sum(map(len, batch)) / batch_s,
        "c1_tok_s": len(alone) / alone_s,
        "batch_steps": batch_steps,
        "batch_step_ms": batch_s * 1000 / batch_steps,
        "batch_comm_s": batch_comm,
        "batch_s": batch_s,
        "c1_steps": alone_steps,
        "c1_step_ms": alone_s * 1000 / alone_steps,
        "c1_comm_s": alone_comm,
        "c1_s": alone_s,
        "rank_peak_rss_mb": rss,
        "tokens": [*batch, alone],
    }


def measure_in_process(
    directory: Path, world: int, run_name: str, seed: int, layout: str = "tp"
) -> dict[str, Any]:
    """`measure` in a fresh interpreter (its peak RSS its own), through `--worker`."""
    command = [sys.executable, __file__, "--worker", str(world), "--model-dir", str(directory)]
    command += ["--config", run_name, "--seed", str(seed), "--layout", layout]
    log(f"world size {world}: {' '.join(command[1:])}")
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- report ---------------------------------------------------------------------------------
def comm_share(figures: dict[str, Any], scenario: str) -> float:
    return sum(figures[f"{scenario}_comm_s"].values()) / figures[f"{scenario}_s"]


def mismatches(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for x, y in zip(a, b, strict=True))


def print_rows(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for index, row in enumerate(rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def report(metrics: dict[str, Any], tp2: dict[str, Any]) -> None:
    def ratio(a: float, b: float) -> str:
        return fmt(a / b) if b else "-"

    weights_ratio = metrics["tp2_rank_weights_rss_mb"] / max(metrics["tp1_weights_rss_mb"], 1.0)

    def compared(label: str, tp1: str, tp2: str) -> tuple[str, ...]:
        return (label, fmt(metrics[tp1]), fmt(metrics[tp2]), ratio(metrics[tp2], metrics[tp1]))

    met = weights_ratio <= RSS_WEIGHTS_TARGET
    comm = f"{metrics['comm_share_tp2']:.1%} / {metrics['comm_share_tp2_c1']:.1%}"
    mismatches = metrics["greedy_mismatches"]
    rows = [
        ("metric", "tp1", "tp2", "tp2/tp1", "target", "met"),
        (*compared("tok_s (batch)", "tp1_tok_s", "tp2_tok_s"), "-", "-"),
        (*compared("c1_tok_s (alone)", "tp1_c1_tok_s", "tp2_c1_tok_s"), "-", "-"),
        (*compared("peak_rss_mb (largest rank)", "tp1_peak_rss_mb", "tp2_rank_peak_rss_mb"),)
        + ("-", "-"),
        (
            *compared(
                f"  minus base {metrics['base_rss_mb']:.0f} MB",
                "tp1_weights_rss_mb",
                "tp2_rank_weights_rss_mb",
            ),
            f"<= {RSS_WEIGHTS_TARGET}",
            "yes" if met else "no",
        ),
        ("comm share of step (batch / alone)", "0", comm, "-", "-", "-"),
        ("greedy_mismatches", "-", str(mismatches), "-", "0", "yes" if mismatches == 0 else "no"),
    ]
    print_rows(rows)
    print(
        f"\nrank 0's time per step in collectives, tp2 (ranks' peak RSS: {tp2['rank_peak_rss_mb']})"
    )
    rows = [("collective", "batch ms/step", "share", "alone ms/step", "share")]
    for label in sorted(set(COLLECTIVES.values())):
        cells = []
        for scenario in ("batch", "c1"):
            seconds = tp2[f"{scenario}_comm_s"].get(label, 0.0)
            cells += [f"{seconds * 1000 / tp2[f'{scenario}_steps']:.3f}"]
            cells += [f"{seconds / tp2[f'{scenario}_s']:.1%}"]
        rows.append((label, *cells))
    rows.append(
        (
            "step (wall)",
            f"{tp2['batch_step_ms']:.3f}",
            "100%",
            f"{tp2['c1_step_ms']:.3f}",
            "100%",
        )
    )
    print_rows(rows)


def comm_ms_per_step(figures: dict[str, Any]) -> dict[str, dict[str, float]]:
    return {
        scenario: {
            label: seconds * 1000 / figures[f"{scenario}_steps"]
            for label, seconds in figures[f"{scenario}_comm_s"].items()
        }
        for scenario in ("batch", "c1")
    }


def report_moe(metrics: dict[str, Any], moe: dict[str, dict[str, Any]]) -> None:
    """The MoE table: one rank, experts spread under tensor-parallel attention (ep2) and under
    data-parallel attention (dp2), and rank 0's time per batch step in each collective."""
    print("\nMixtral: one rank, experts spread (ep2), data-parallel attention (dp2)")
    rows = [("metric", "tp1", "ep2", "dp2", "ep2/tp1", "dp2/tp1")]
    for label, key in (("tok_s (batch)", "tok_s"), ("c1_tok_s (alone)", "c1_tok_s")):
        figures = [metrics[f"moe_{name}_{key}"] for name in ("tp1", "ep2", "dp2")]
        rows.append(
            (label, *map(fmt, figures), fmt(figures[1] / figures[0]), fmt(figures[2] / figures[0]))
        )
    for label in sorted(set(COLLECTIVES.values())):
        cells = [
            f"{moe[name]['batch_comm_s'].get(label, 0.0) * 1000 / moe[name]['batch_steps']:.3f}"
            for name in ("ep2", "dp2")
        ]
        rows.append((f"{label} ms/step (batch)", "0", *cells, "-", "-"))
    shares = [f"{metrics[f'comm_share_{name}']:.1%}" for name in ("ep2", "dp2")]
    rows.append(("comm share of step (batch)", "0", *shares, "-", "-"))
    rows.append(("greedy_mismatches", "-", "-", str(metrics["moe_greedy_mismatches"]), "-", "-"))
    print_rows(rows)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small", help="model size")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts")
    parser.add_argument("--out", type=Path, help="JSON path (default: bench/results/...)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # world size to measure
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    run = CONFIGS[args.config]
    if args.worker is not None:
        print(json.dumps(measure(args.model_dir, args.worker, run, args.seed, args.layout)))
        return
    load_start = os.getloadavg()[0]
    if load_start > 0.5:
        log(f"warning: 1-minute load average is {load_start:.2f}; results will be noisy")
    with tempfile.TemporaryDirectory(prefix="hearth-parallel-") as tmp:
        directory = Path(tmp)
        params = build_model(directory, run.model, args.seed)
        shape = ", ".join(f"{key}={value}" for key, value in run.model.items())
        print(f"model ({args.config}): Llama, random weights, float32, {shape}")
        print(f"  {params / 1e6:.1f} M parameters ({params * 4 / 2**20:.0f} MiB)")
        print(
            f"  {run.concurrency} prompts of {run.prompt_tokens} tokens, {run.new_tokens} new "
            f"tokens each; {cpu_count()} cores shared by the ranks; gloo on {platform.machine()}"
        )
        base = measure_in_process(directory, 0, args.config, args.seed)
        tp1 = measure_in_process(directory, 1, args.config, args.seed)
        tp2 = measure_in_process(directory, 2, args.config, args.seed)
    with tempfile.TemporaryDirectory(prefix="hearth-parallel-moe-") as tmp:
        directory = Path(tmp)
        moe_params = build_model(directory, run.moe_model, args.seed, moe=True)
        shape = ", ".join(f"{key}={value}" for key, value in run.moe_model.items())
        print(f"model (MoE): Mixtral, random weights, float32, {shape}")
        print(f"  {moe_params / 1e6:.1f} M parameters; the same prompts")
        moe = {
            name: measure_in_process(directory, world, args.config, args.seed, layout)
            for name, world, layout in (("tp1", 1, "tp"), ("ep2", 2, "ep"), ("dp2", 2, "dp"))
        }
    base_rss = base["rank_peak_rss_mb"][0]
    metrics: dict[str, Any] = {
        "tp1_tok_s": tp1["tok_s"],
        "tp2_tok_s": tp2["tok_s"],
        "tp1_c1_tok_s": tp1["c1_tok_s"],
        "tp2_c1_tok_s": tp2["c1_tok_s"],
        "tp1_peak_rss_mb": tp1["rank_peak_rss_mb"][0],
        "tp2_rank_peak_rss_mb": max(tp2["rank_peak_rss_mb"]),
        "base_rss_mb": base_rss,
        "tp1_weights_rss_mb": tp1["rank_peak_rss_mb"][0] - base_rss,
        "tp2_rank_weights_rss_mb": max(tp2["rank_peak_rss_mb"]) - base_rss,
        "comm_share_tp2": comm_share(tp2, "batch"),
        "comm_share_tp2_c1": comm_share(tp2, "c1"),
        "greedy_mismatches": mismatches(tp1["tokens"], tp2["tokens"]),
        "moe_tp1_tok_s": moe["tp1"]["tok_s"],
        "moe_ep2_tok_s": moe["ep2"]["tok_s"],
        "moe_dp2_tok_s": moe["dp2"]["tok_s"],
        "moe_tp1_c1_tok_s": moe["tp1"]["c1_tok_s"],
        "moe_ep2_c1_tok_s": moe["ep2"]["c1_tok_s"],
        "moe_dp2_c1_tok_s": moe["dp2"]["c1_tok_s"],
        "comm_share_ep2": comm_share(moe["ep2"], "batch"),
        "comm_share_dp2": comm_share(moe["dp2"], "batch"),
        "moe_greedy_mismatches": mismatches(moe["tp1"]["tokens"], moe["ep2"]["tokens"])
        + mismatches(moe["tp1"]["tokens"], moe["dp2"]["tokens"]),
    }
    report(metrics, tp2)
    report_moe(metrics, moe)
    result = {
        "bench": "parallel",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "config": args.config,
        "run": asdict(run),
        "params": params,
        "cores": cpu_count(),
        "torch": torch.__version__,
        "metrics": metrics,
        "tp2_rank_peak_rss_mb_each": tp2["rank_peak_rss_mb"],
        "tp2_comm_ms_per_step": comm_ms_per_step(tp2),
        "moe_params": moe_params,
        "moe_comm_ms_per_step": {name: comm_ms_per_step(moe[name]) for name in ("ep2", "dp2")},
        "step_ms": {
            "tp1_batch": tp1["batch_step_ms"],
            "tp2_batch": tp2["batch_step_ms"],
            "tp1_c1": tp1["c1_step_ms"],
            "tp2_c1": tp2["c1_step_ms"],
        },
    }
    suffix = "" if args.config == "small" else f"-{args.config}"
    write_json(result, args.out or RESULTS_DIR / f"parallel{suffix}.json")
    print(json.dumps(metrics))


if __name__ == "__main__":
    main()
