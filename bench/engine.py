"""Engine benchmark: Hearth's inference engine against Hugging Face `generate()` and llama.cpp.

Runs SmolLM2-135M-Instruct on CPU, in one process (llama.cpp in a child), and measures:

- `engine_c32_tok_s`: our engine (default config, bf16) with 32 chat prompts submitted at once,
  greedy, 64 new tokens each (`ignore_eos`), as generated tokens per wall-clock second.
- `engine_c1_tok_s`: the same engine serving the first 8 prompts one at a time.
- `engine_int4_c1_tok_s`: the same, with the decoder's weights in int4 (`quantization="int4"`,
  requantized from the GGUF's own Q4_1 blocks; the default stays bf16).
- `hf_batched_tok_s`: HF `model.generate` (float32) on all 32 prompts as one left-padded batch.
- `hf_sequential_tok_s`: HF `model.generate` (float32) on the first 4 prompts one at a time.
- `llamacpp_sequential_tok_s`: llama.cpp (Q4_1 GGUF, 2 threads) on the first 8 prompts one at
  a time, in a child process, with ggml's AMX path off (it segfaults here); null when
  `llama_cpp` is not installed or crashes.
- `cold_ttft_s` / `warm_ttft_s`: time to first token for a ~2,300-token system prompt plus a
  user turn, first on an empty prefix cache, then with another user turn so that only the
  system prefix is shared (`warm_cached_tokens` is how much of it the engine reused).
- `hf_prefill_s`: one HF float32 forward pass over the cold prompt.
- `peak_rss_mb`: the process's peak resident memory at the end (details also give the peak
  after the engine phase and the RSS left once the engine was freed).

It prints a table (metric, value, baseline, ratio, target, met) and, as the last line of stdout,
one JSON object, which it also writes to bench/results/engine.json (engine-quick.json with
`--quick`). Progress goes to stderr.

    .venv/bin/python bench/engine.py                # full run (about a minute on 2 idle cores)
    .venv/bin/python bench/engine.py --quick        # smoke run: 8 prompts, 16 tokens
    .venv/bin/python bench/engine.py --skip-hf --skip-llamacpp
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib.util
import json
import multiprocessing
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

# `python bench/engine.py` puts bench/ on sys.path, not the repository root.
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.concurrency import (  # noqa: E402
    CURVE_SIZES,
    busy_core,
    curve_prompts,
    engine_curve,
    hf_curve,
)
from bench.hardware import ceiling_tok_s, measure_limits  # noqa: E402
from inference.engine import LLM, SamplingParams  # noqa: E402
from inference.engine.tokenizer import Tokenizer  # noqa: E402
from inference.models.loader import default_model_gguf, resolve_model_directory  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
RESULTS_DIR = REPO_ROOT / "bench" / "results"
# The cold/warm TTFT prompt must be long enough that prefill dominates; the range is a guard
# against the system prompt or the chat template drifting.
LONG_PROMPT_TOKENS = (2250, 2350)
RSS_LIMIT_MB = 2000.0

QUESTIONS = (
    "What is the capital of France?",
    "Explain recursion to a ten-year-old.",
    "Write a haiku about autumn rain.",
    "What are three tips for staying focused while studying?",
    "How does a refrigerator keep food cold?",
    "Give me a short recipe for pancakes.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in a few sentences.",
    "What is the difference between a list and a tuple in Python?",
    "Suggest a name for a friendly robot that helps in the kitchen.",
    "How do vaccines train the immune system?",
    "Write a polite email declining a meeting invitation for next Tuesday afternoon.",
    "What causes the seasons on Earth?",
    "List five animals that live in the Arctic.",
    "How can I make my houseplants grow better in a dark apartment?",
    "Explain what an API is, using a restaurant as an analogy.",
    "What is photosynthesis?",
    "Translate 'good morning, how are you?' into Spanish and explain the grammar.",
    "Describe a sunset over the ocean in two sentences.",
    "What are the pros and cons of working from home?",
    "How many minutes are there in a week? Show your reasoning.",
    "Write a limerick about a cat who loves to code.",
    "What is a black hole?",
    "Give three ideas for a rainy-day activity with children.",
    "Why do we need sleep, and what happens if we do not get enough?",
    "Explain the difference between weather and climate.",
    "What should I pack for a weekend hiking trip in the mountains in early spring?",
    "How does compound interest work? Give a small numeric example.",
    "Tell me a fun fact about octopuses.",
    "What is the Pythagorean theorem and where is it used in everyday life?",
    "Write a short motivational message for someone starting a new job.",
    "How do I politely ask my neighbour to turn down loud music late at night?",
)

# A plausible agent instruction document (about 2,250 tokens): the shared prefix for TTFT.
SYSTEM_SECTIONS = (
    """# Operating guide for the repository assistant

You are a coding agent working inside a customer's software repository. You read files, run \
commands in a sandbox, and propose or apply changes. This guide describes how to behave. Follow \
it unless the user explicitly asks for something different, and when the two conflict, explain \
the conflict briefly before doing what the user asked.""",
    """## 1. Understanding the task

Before touching any file, restate the goal to yourself in one or two sentences. Identify the \
inputs you were given: an issue description, a failing test, a stack trace, a design note, or a \
loose request in chat. If the request is ambiguous in a way that changes the outcome (for \
example, whether a function should raise or return None on bad input), ask one focused question. \
If the ambiguity is cosmetic, pick the option most consistent with the surrounding code and say \
which one you picked.""",
    """## 2. Exploring the codebase

Start from the entry points that the task names. Use directory listings and text search before \
opening large files. Read the module docstring, the public functions, and the tests that cover \
them. Note the project's conventions: naming, error handling, logging, how configuration is \
passed around, and whether the code favours dataclasses, plain dictionaries, or classes with \
behaviour. Prefer reading a file once, thoroughly, over skimming it five times. Keep a short \
list of the files you expect to change and the files you only need to understand.""",
    """## 3. Planning a change

Write a small plan: the files to edit, the functions to add or modify, and the tests that will \
prove the change works. Keep the change as small as the task allows. Do not rename, reformat, or \
reorganise code you were not asked to touch; unrelated churn makes review harder and hides the \
real change. If you find a separate bug along the way, mention it in your summary instead of \
fixing it silently, unless it blocks the task.""",
    """## 4. Writing code

Match the style of the file you are editing. Use the same quoting, the same import ordering, and \
the same level of type annotation. Give functions names that say what they return or what they \
do, and keep them short enough to read without scrolling. Comments should explain why something \
is done, not restate what the next line does. Avoid clever one-liners when a plain loop is \
clearer. Never leave debugging prints, commented-out blocks, or placeholder values such as \
TODO, FIXME, or example.com endpoints in the final change.""",
    """### 4.1 Error handling

Validate inputs at the boundary of the system: request handlers, command-line parsers, and \
public library functions. Inside the system, trust the types and avoid defensive checks that \
cannot fail. Raise specific exception types with messages that name the offending value and \
the rule it broke. Do not catch broad exceptions unless you re-raise them or report them to a \
place where a human will see them. A silent `except Exception: pass` is almost always a bug.""",
    """### 4.2 Dependencies

Use the standard library and the packages the project already depends on. Adding a dependency \
needs a reason that outweighs its cost: installation size, licence, security updates, and one \
more thing that can break. If you do add one, pin it the way the project pins its other \
dependencies and update the lock file in the same change. Never download code or models at \
runtime from an address the user did not approve.""",
    """### 4.3 Performance

Measure before optimising. When a change is meant to make something faster, include the numbers \
before and after, the machine they were taken on, and the command that produced them. Prefer \
algorithmic improvements over micro-optimisations, and keep the simple version when the gain is \
within measurement noise. Watch memory as well as time: a cache that makes a request ten percent \
faster but doubles resident memory may be a bad trade on a small server.""",
    """## 5. Testing

Every behavioural change needs a test that fails before the change and passes after it. Put the \
test next to the existing tests for the same module and follow their structure. Test the public \
behaviour rather than private helpers. Cover the edge cases that the task mentions, plus empty \
inputs, very large inputs, and inputs with unusual characters where those are plausible. Keep \
tests deterministic: seed random number generators, freeze the clock when time matters, and \
avoid depending on the network. Run the narrowest relevant test first, then the whole suite.""",
    """### 5.1 When tests fail

Read the full failure output, including the first error, not only the last line. Reproduce the \
failure with the smallest command you can. If a test was already failing before your change, \
say so and leave it alone unless fixing it is part of the task. Never weaken an assertion, add \
a skip marker, or increase a timeout just to make a failure disappear; find the cause. If the \
cause is an environment problem, such as a missing system library, report it clearly.""",
    """## 6. Running commands

Commands run in a sandbox with limited CPU, memory, and time. Prefer commands that finish in \
seconds. Use flags that limit output, such as a maximum count for search results or a quiet mode \
for test runners, so that the important lines are not buried. Do not start long-lived servers \
unless the task needs them, and stop any process you started before you finish. Never run \
commands that delete data outside the working directory, change global configuration, or \
contact external services without the user's permission.""",
    """## 7. Version control

Work on the branch you were given. Make commits small and focused, each with a message whose \
first line says what changed in the imperative mood, followed by a blank line and a short \
explanation of why. Do not rewrite published history, force-push, or amend commits that other \
people may have pulled. If the repository has a pull request template or a changelog, fill it \
in. When a merge conflict appears, resolve it by understanding both sides, not by picking one \
side wholesale.""",
    """## 8. Security and privacy

Treat every secret as radioactive. Do not print, log, or commit API keys, passwords, tokens, or \
private keys, even in test fixtures; use obviously fake values instead. When code handles user \
data, collect only what is needed, and keep it out of logs. Escape or parameterise everything \
that reaches a shell, a database query, or an HTML page. If you notice a vulnerability in \
existing code, report it in your summary with its location and a suggested fix.""",
    """## 9. Documentation

Update documentation in the same change as the code it describes: docstrings, the README, \
command-line help, configuration references, and examples. Write for a reader who knows the \
language but not this project. Show a short example for every new public function or option. \
Keep line lengths and heading styles consistent with the existing documents. Delete \
documentation for features you removed rather than leaving it to mislead the next reader.""",
    """## 10. Communicating with the user

Be brief and concrete. When you finish, summarise what you changed, where, and how you verified \
it, in a few sentences or a short list. Quote exact error messages rather than paraphrasing \
them. State plainly what you did not do and why: tests you could not run, questions that remain \
open, assumptions you made. Do not claim that something works unless you ran it. If you are \
unsure, say how unsure and what would settle the question.""",
    """## 11. Working with data files

Large data files, such as CSV exports, JSON dumps, or binary model weights, should be inspected \
with tools that read only part of them: the first few lines, a row count, or a schema summary. \
Do not load a multi-gigabyte file into memory to answer a question about its header. When you \
transform data, write the result to a new file and keep the original until the user confirms \
the output. Record the command that produced every derived file so the step can be repeated.""",
    """## 12. Language-specific notes

In Python, follow the formatter and linter the project configures, use type hints on public \
functions, and prefer pathlib over string paths. In JavaScript and TypeScript, respect the \
existing module system and do not mix promise chains with async functions in the same file. In \
Go, return errors rather than panicking, and wrap them with context. In Rust, avoid unwrap in \
library code and document every unsafe block with the invariant it relies on. In SQL migrations, \
make each step reversible where the database allows it.""",
    """## 13. Reviewing someone else's change

When asked to review, read the description first, then the tests, then the implementation. \
Separate blocking problems, such as incorrect behaviour, data loss, or security issues, from \
suggestions about naming and style. Explain each blocking problem with a concrete input that \
triggers it. Acknowledge what the change does well. Do not request changes that are outside \
the scope of the pull request; open a separate note for them instead.""",
    """## 14. Handling long tasks

Some tasks need many steps. Keep a running list of what is done and what remains, and update \
it as you go. After every significant step, check that the project still builds and the \
relevant tests still pass, so that a failure can be traced to the step that caused it. If you \
run out of time or budget, stop at a consistent state, describe exactly where you stopped, and \
list the next steps so that someone else can continue.""",
    """## 15. Final checklist

Before you report completion, confirm each of the following. The change does what was asked and \
nothing else. The new and existing tests pass. The linter and formatter are clean. The \
documentation matches the behaviour. No secrets, debugging output, or temporary files remain. \
The summary names every file you changed and every command you ran to verify the work.""",
    """## 16. Configuration and environment

Read configuration from the places the project already uses, such as environment variables, a \
settings module, or a configuration file, and give every new option a sensible default. Document \
each option where the others are documented. Do not hard-code paths, hostnames, or credentials. \
When behaviour depends on the operating system, test the branch you can run and describe the \
branches you could not.""",
    """## 17. Logging and observability

Log events that an operator would need at three in the morning: what failed, for which request, \
and what the system did about it. Use the project's logger and its levels consistently. Keep \
messages short and searchable.""",
)
SYSTEM_PROMPT = "\n\n".join(SYSTEM_SECTIONS)
# Warm-up, cold and warm requests share the system prompt and differ in the user turn.
LONG_PROMPT_QUESTIONS = {
    "warmup": "Which files should I read first in an unfamiliar repository?",
    "cold": "How should I add a new command-line flag to this project?",
    "warm": "A test fails only on CI but passes locally. What should I check first?",
}


@dataclass(frozen=True)
class BenchConfig:
    """Sizes of each measurement; `--quick` shrinks them for a smoke run."""

    num_prompts: int = 32
    new_tokens: int = 64
    engine_sequential_prompts: int = 8
    hf_sequential_prompts: int = 4
    llamacpp_sequential_prompts: int = 8
    curve: tuple[int, ...] = CURVE_SIZES


FULL = BenchConfig()
QUICK = BenchConfig(
    num_prompts=8,
    new_tokens=16,
    engine_sequential_prompts=2,
    hf_sequential_prompts=1,
    llamacpp_sequential_prompts=2,
    curve=(1, 4, 8),
)


@dataclass(frozen=True)
class Throughput:
    tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class Ttft:
    wall_s: float
    engine_s: float | None
    prompt_tokens: int
    cached_tokens: int


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def cpu_count() -> int:
    # The affinity mask, not os.cpu_count(): a container may be limited to fewer cores.
    return len(os.sched_getaffinity(0))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def current_rss_mb() -> float:
    resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def release_freed_memory() -> None:
    """Hand freed heap back to the OS: glibc keeps it (~250 MB after the engine), which would
    count against the next phase's resident memory."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


# ---- prompts --------------------------------------------------------------------------------
def long_prompt(tokenizer: Tokenizer, kind: str) -> list[int]:
    """The ~2,300-token system prompt followed by the user turn named by `kind`."""
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": LONG_PROMPT_QUESTIONS[kind]},
    ]
    ids = tokenizer.apply_chat_template(messages)
    low, high = LONG_PROMPT_TOKENS
    if not low <= len(ids) <= high:
        raise RuntimeError(f"the {kind} long prompt has {len(ids)} tokens, expected {low}-{high}")
    return ids


# ---- our engine ---------------------------------------------------------------------------
def greedy(max_tokens: int) -> SamplingParams:
    # ignore_eos: every request must really produce max_tokens, like HF's min_new_tokens.
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def engine_outputs(
    llm: LLM, prompts: list[list[int]], new_tokens: int, namespace: str
) -> tuple[list[Any], float]:
    """Submit all prompts at once; the finished requests (with their timings) and the wall
    time."""
    outs, seconds = timed(lambda: llm.generate(prompts, greedy(new_tokens), namespace=namespace))
    check_lengths("engine", [o.token_ids for o in outs], new_tokens)
    return outs, seconds


def engine_generate(
    llm: LLM, prompts: list[list[int]], new_tokens: int, namespace: str
) -> tuple[Throughput, list[list[int]]]:
    """Submit all prompts at once; return throughput and the generated token ids."""
    outs, seconds = engine_outputs(llm, prompts, new_tokens, namespace)
    tokens = [o.token_ids for o in outs]
    return Throughput(sum(len(t) for t in tokens), seconds), tokens


def engine_sequential(
    llm: LLM, prompts: list[list[int]], new_tokens: int, namespace: str
) -> tuple[Throughput, list[list[int]]]:
    """One request at a time. One namespace for the run: the chat template's default system
    block is legitimately shared between requests, as llama.cpp also reuses a common prefix."""
    tokens: list[list[int]] = []
    total = 0.0
    for prompt in prompts:
        run, outputs = engine_generate(llm, [prompt], new_tokens, namespace)
        tokens.extend(outputs)
        total += run.seconds
    return Throughput(sum(len(t) for t in tokens), total), tokens


def engine_ttft(llm: LLM, prompt: list[int], request_id: str, namespace: str) -> Ttft:
    """Wall-clock time from add_request to the first step that returns a token."""
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request(request_id, prompt, greedy(1), namespace=namespace)
    first_token_s: float | None = None
    final = None
    while final is None:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if out.token_ids and first_token_s is None:
                first_token_s = time.perf_counter() - start
            if out.finished:
                final = out
    assert first_token_s is not None, "a max_tokens=1 request finished without a token"
    return Ttft(first_token_s, final.timings.ttft_s, final.prompt_tokens, final.cached_tokens)


def run_engine(
    config: BenchConfig,
    prompts: list[list[int]],
    long_prompts: dict[str, list[int]],
    curve: tuple[int, ...],
) -> tuple[dict[str, Any], list[list[int]]]:
    """Every engine measurement; returns metrics and the sequential run's outputs."""
    llm, load_s = timed(lambda: LLM(MODEL))
    log(f"engine loaded in {load_s:.1f}s (dtype={llm.engine.config.dtype})")
    dtype = {"bf16": "bfloat16", "fp32": "float32"}.get(llm.engine.config.dtype)
    dtype = dtype or llm.engine.config.dtype

    # Warm-up: first-call costs (allocator, kernel selection) are not what we measure.
    engine_generate(llm, prompts[:2], 4, namespace="warmup")

    # A namespace per run, so no run hits blocks cached by an earlier one.
    batch, _ = engine_generate(
        llm, prompts[: config.num_prompts], config.new_tokens, namespace="c32-run"
    )
    log(f"engine c{config.num_prompts}: {batch.tokens} tokens in {batch.seconds:.2f}s")
    seq_prompts = prompts[: config.engine_sequential_prompts]
    seq, seq_tokens = engine_sequential(llm, seq_prompts, config.new_tokens, "c1-run")
    log(f"engine c1: {seq.tokens} tokens in {seq.seconds:.2f}s")

    # The warm-up request runs the long-prompt path once in its own namespace, so `cold`
    # means "nothing cached", not "first long prefill this process has done".
    engine_ttft(llm, long_prompts["warmup"], "ttft-warmup", namespace="ttft-warmup")
    cold = engine_ttft(llm, long_prompts["cold"], "ttft-cold", namespace="ttft")
    warm = engine_ttft(llm, long_prompts["warm"], "ttft-warm", namespace="ttft")
    log(f"engine ttft: cold {cold.wall_s:.3f}s, warm {warm.wall_s:.4f}s")

    points = engine_curve(llm, prompts, config.new_tokens, engine_outputs, curve)
    for point in points:
        log(f"engine curve c{point['concurrency']}: {point['tok_s']:.1f} tok/s")
    with busy_core():
        busy, _ = engine_generate(
            llm, prompts[: config.num_prompts], config.new_tokens, namespace="c32-busy"
        )
    log(f"engine c{config.num_prompts}, one core busy: {busy.tok_s:.1f} tok/s")

    metrics = {
        "engine_c32_tok_s": batch.tok_s,
        "engine_c1_tok_s": seq.tok_s,
        "cold_ttft_s": cold.wall_s,
        "warm_ttft_s": warm.wall_s,
        "warm_cached_tokens": warm.cached_tokens,
        "engine_c32_busy_tok_s": busy.tok_s,
        "curve": points,
        "details": {
            "engine_dtype": dtype,
            "engine_load_s": load_s,
            "engine_c32": asdict(batch),
            "engine_c1": asdict(seq),
            "engine_cold_ttft": asdict(cold),
            "engine_warm_ttft": asdict(warm),
        },
    }
    return metrics, seq_tokens


def run_engine_int4(config: BenchConfig, prompts: list[list[int]]) -> dict[str, Any]:
    """One request at a time with the decoder's weights in int4 (`quantization="int4"`): the
    same 4-bit information llama.cpp reads from the Q4_1 file, a quarter of the bf16 bytes."""
    llm = LLM(MODEL, quantization="int4")
    engine_generate(llm, prompts[:2], 4, namespace="warmup")
    seq_prompts = prompts[: config.engine_sequential_prompts]
    seq, _ = engine_sequential(llm, seq_prompts, config.new_tokens, "c1-int4-run")
    log(f"engine int4 c1: {seq.tokens} tokens in {seq.seconds:.2f}s")
    return {"engine_int4_c1_tok_s": seq.tok_s, "details": {"engine_int4_c1": asdict(seq)}}


def check_lengths(who: str, outputs: list[list[int]], expected: int) -> None:
    """Throughput is only comparable if every request made exactly `expected` tokens."""
    wrong = [len(o) for o in outputs if len(o) != expected]
    if wrong:
        raise RuntimeError(f"{who}: {len(wrong)} outputs are not {expected} tokens: {wrong[:5]}")


# ---- Hugging Face -----------------------------------------------------------------------------
def load_hf() -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = str(resolve_model_directory(MODEL))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.padding_side = "left"  # decoder-only batching: pad on the left
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def hf_generate(
    model: Any, tokenizer: Any, prompts: list[list[int]], new_tokens: int
) -> tuple[Throughput, list[list[int]]]:
    """One static batch through `model.generate`; prompts are left-padded token ids."""
    batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    with torch.inference_mode():
        out, seconds = timed(
            lambda: model.generate(
                **batch,
                do_sample=False,
                min_new_tokens=new_tokens,
                max_new_tokens=new_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
    generated = out[:, batch["input_ids"].shape[1] :].tolist()
    check_lengths("hf", generated, new_tokens)
    return Throughput(len(generated) * new_tokens, seconds), generated


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def hf_prefill(model: Any, prompt: list[int]) -> float:
    input_ids = torch.tensor([prompt])
    with torch.inference_mode():
        _, seconds = timed(lambda: model(input_ids))
    return seconds


def run_hf(
    config: BenchConfig,
    prompts: list[list[int]],
    long_prompt_ids: list[int],
    engine_outputs: list[list[int]],
    hf_max: int,
) -> dict[str, Any]:
    """HF float32 baselines; `engine_outputs` (the engine's sequential run) are compared with
    HF's greedy outputs for the same prompts as a sanity check of the engine's numerics."""
    (model, tokenizer), load_s = timed(load_hf)
    log(f"HF float32 loaded in {load_s:.1f}s")

    hf_generate(model, tokenizer, prompts[:1], 4)  # warm-up, as for the engine
    batch = prompts[: config.num_prompts]
    batched, _ = hf_generate(model, tokenizer, batch, config.new_tokens)
    log(f"HF batched: {batched.tokens} tokens in {batched.seconds:.2f}s")
    with busy_core():
        busy, _ = hf_generate(model, tokenizer, batch, config.new_tokens)
    log(f"HF batched, one core busy: {busy.tok_s:.1f} tok/s")
    points = hf_curve(model, tokenizer, prompts, config.new_tokens, hf_generate, hf_max)
    runs = [
        hf_generate(model, tokenizer, [p], config.new_tokens)
        for p in prompts[: config.hf_sequential_prompts]
    ]
    sequential = Throughput(sum(r.tokens for r, _ in runs), sum(r.seconds for r, _ in runs))
    hf_outputs = [tokens[0] for _, tokens in runs]
    log(f"HF sequential: {sequential.tokens} tokens in {sequential.seconds:.2f}s")
    prefill_s = hf_prefill(model, long_prompt_ids)
    log(f"HF prefill of {len(long_prompt_ids)} tokens: {prefill_s:.3f}s")
    del model
    gc.collect()
    return {
        "hf_batched_tok_s": batched.tok_s,
        "hf_sequential_tok_s": sequential.tok_s,
        "hf_prefill_s": prefill_s,
        "hf_batched_busy_tok_s": busy.tok_s,
        "hf_curve": points,
        "details": {
            "hf_load_s": load_s,
            "hf_batched": asdict(batched),
            "hf_sequential": asdict(sequential),
            # Leading tokens on which engine (bf16) and HF (float32) greedy outputs agree;
            # bf16 rounding makes late divergence normal, very early divergence suspicious.
            "engine_vs_hf_agreeing_prefix": [
                common_prefix(e, h) for e, h in zip(engine_outputs, hf_outputs, strict=False)
            ],
        },
    }


# ---- llama.cpp ------------------------------------------------------------------------------
def run_llamacpp(
    config: BenchConfig, prompts: list[list[int]], long_prompts: dict[str, list[int]], threads: int
) -> dict[str, Any]:
    """llama.cpp in a child process: a crash in its native code (seen: a segfault) costs this
    baseline only, not the whole run; its memory also stays out of our peak RSS."""
    absent = {"llamacpp_sequential_tok_s": None, "llamacpp_warm_ttft_s": None}
    if importlib.util.find_spec("llama_cpp") is None:
        log("llama_cpp is not installed (pip install -e '.[bench]'); skipping llama.cpp")
        return absent
    prompts = prompts[: config.llamacpp_sequential_prompts]
    spawn = multiprocessing.get_context("spawn")  # a clean process, no forked torch threads
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        try:
            run = pool.submit(llamacpp_run, prompts, long_prompts, config.new_tokens, threads)
            result = run.result()
        except BrokenProcessPool:
            log("llama.cpp crashed; its figures are null")
            return {**absent, "details": {"llamacpp": "crashed"}}
    sequential = result["sequential"]
    log(f"llama.cpp sequential: {sequential.tokens} tokens in {sequential.seconds:.2f}s")
    log(f"llama.cpp ttft: cold {result['cold_ttft_s']:.3f}s, warm {result['warm_ttft_s']:.4f}s")
    return {
        "llamacpp_sequential_tok_s": sequential.tok_s,
        "llamacpp_cold_ttft_s": result["cold_ttft_s"],
        "llamacpp_warm_ttft_s": result["warm_ttft_s"],
        "details": {"llamacpp": asdict(sequential)},
    }


def llamacpp_run(
    prompts: list[list[int]], long_prompts: dict[str, list[int]], new_tokens: int, threads: int
) -> dict[str, Any]:
    """In the child process: greedy, `new_tokens` per prompt, one prompt at a time; then the
    time to the first token of the cold long prompt and of the warm one, which shares its
    system prompt (llama.cpp keeps the previous prompt's KV and reuses its common prefix)."""
    import llama_cpp
    from llama_cpp import llama_cpp as bindings

    disable_extra_buffer_types(bindings)
    llm = llama_cpp.Llama(
        model_path=str(default_model_gguf()), n_ctx=4096, n_threads=threads, verbose=False
    )
    take_tokens(llamacpp_stream(llm, prompts[0]), 4)  # warm-up, as for the other engines
    total_tokens, total_s = 0, 0.0
    for prompt in prompts:
        stream = llamacpp_stream(llm, prompt)  # lazy: prefill happens inside the timing
        tokens, seconds = timed(lambda s=stream: take_tokens(s, new_tokens))
        check_lengths("llama.cpp", [tokens], new_tokens)
        total_tokens += len(tokens)
        total_s += seconds
    ttft = {}
    for kind in ("cold", "warm"):
        stream = llamacpp_stream(llm, long_prompts[kind])
        _, ttft[kind] = timed(lambda s=stream: take_tokens(s, 1))
    return {
        "sequential": Throughput(total_tokens, total_s),
        "cold_ttft_s": ttft["cold"],
        "warm_ttft_s": ttft["warm"],
    }


def disable_extra_buffer_types(bindings: Any) -> None:
    """Turn off ggml's "extra" CPU weight layouts (AMX, repacking).

    On this AMX-capable CPU, llama-cpp-python 0.3.36 segfaults in ggml_backend_amx_mul_mat on
    the first decode of this model. `Llama()` has no option for it, so patch the defaults that
    its constructor starts from (it calls them through the low-level `llama_cpp.llama_cpp`).
    """
    default_params = bindings.llama_model_default_params

    def params_without_extra_bufts() -> Any:
        params = default_params()
        if hasattr(params, "use_extra_bufts"):
            params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = params_without_extra_bufts


def llamacpp_stream(llm: Any, prompt: list[int]) -> Any:
    # generate() never stops at EOS by itself (like ignore_eos); temp=0 is greedy.
    return llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0)


def take_tokens(stream: Any, count: int) -> list[int]:
    tokens: list[int] = []
    for token in stream:
        tokens.append(token)
        if len(tokens) == count:
            break
    return tokens


# ---- report ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """`metric` compared with `baseline` (`value / baseline` against `factor`)."""

    key: str
    metric: str
    baseline: str | None
    factor: float
    at_least: bool  # True: ratio >= factor; False: ratio <= factor


TARGETS = (
    Target("c32_vs_ceiling", "engine_c32_tok_s", "ceiling_c32_tok_s", 0.5, True),
    Target("warm_ttft_vs_llamacpp", "warm_ttft_s", "llamacpp_warm_ttft_s", 1.0, False),
    Target("busy_vs_idle_c32", "engine_c32_busy_tok_s", "engine_c32_tok_s", 0.5, True),
    Target("busy_vs_hf_busy_c32", "engine_c32_busy_tok_s", "hf_batched_busy_tok_s", 2.0, True),
    Target("c32_vs_hf_batched", "engine_c32_tok_s", "hf_batched_tok_s", 8.0, True),
    Target("c1_vs_hf_sequential", "engine_c1_tok_s", "hf_sequential_tok_s", 5.0, True),
    Target("c1_vs_llamacpp", "engine_c1_tok_s", "llamacpp_sequential_tok_s", 1.0, True),
    Target("int4_c1_vs_hf_sequential", "engine_int4_c1_tok_s", "hf_sequential_tok_s", 5.0, True),
    Target("int4_c1_vs_llamacpp", "engine_int4_c1_tok_s", "llamacpp_sequential_tok_s", 1.0, True),
    Target("cold_ttft_vs_hf_prefill", "cold_ttft_s", "hf_prefill_s", 0.25, False),
    Target("warm_vs_cold_ttft", "warm_ttft_s", "cold_ttft_s", 0.03, False),
    Target("peak_rss", "peak_rss_mb", None, RSS_LIMIT_MB, False),
)


def evaluate(target: Target, metrics: dict[str, Any]) -> tuple[float | None, bool | None]:
    """(ratio, met); None where a value was not measured."""
    value = metrics.get(target.metric)
    if value is None:
        return None, None
    if target.baseline is None:  # an absolute limit: compare the value itself
        ratio, compared = None, value
    else:
        baseline = metrics.get(target.baseline)
        if not baseline:
            return None, None
        ratio = compared = value / baseline
    met = compared >= target.factor if target.at_least else compared <= target.factor
    return ratio, met


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    # Three significant digits, but never scientific notation for large values (RSS in MB).
    return f"{value:.0f}" if abs(value) >= 10**digits else f"{value:.{digits}g}"


def print_table(metrics: dict[str, Any]) -> None:
    header = ("metric", "value", "baseline", "ratio", "target", "met")
    rows = [header]
    for target in TARGETS:
        ratio, met = evaluate(target, metrics)
        op = ">=" if target.at_least else "<="
        if target.baseline is None:
            baseline, goal = "-", f"{op} {target.factor:g}"
        else:
            baseline = f"{target.baseline}={fmt(metrics.get(target.baseline))}"
            goal = f"{op} {target.factor:g}x"
        met_text = "n/a" if met is None else "yes" if met else "no"
        rows.append(
            (target.metric, fmt(metrics.get(target.metric)), baseline, fmt(ratio), goal, met_text)
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for index, row in enumerate(rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def write_json(result: dict[str, Any], path: Path) -> None:
    # Write then rename, so an interrupted run never leaves a truncated results file.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(path)


DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


def decode_parameters(directory: Path) -> int:
    """The parameters a decode step reads: every projection of every layer, the norms, and the
    LM head (the embedding too when it is not tied; a lookup reads a row)."""
    from inference.models.model_config import ModelConfig, read_hf_config

    config = ModelConfig.from_hf(read_hf_config(directory))
    hidden, dim = config.hidden_size, config.head_dim
    attention = hidden * dim * (2 * config.num_heads + 2 * config.num_kv_heads)
    layer = attention + 3 * hidden * config.intermediate_size + 2 * hidden
    return config.num_layers * layer + hidden + config.vocab_size * hidden


def curve_table(
    engine: list[dict[str, Any]], hf: list[dict[str, Any]] | None, ceilings: dict[int, float]
) -> list[dict[str, Any]]:
    """Each size's engine figures beside HF's and the ceiling."""
    hf_by_size = {point["concurrency"]: point for point in hf or []}
    rows = []
    for point in engine:
        size = point["concurrency"]
        hf_point = hf_by_size.get(size, {})
        rows.append(
            {
                **point,
                "ceiling_tok_s": ceilings[size],
                "fraction_of_ceiling": point["tok_s"] / ceilings[size],
                "hf_tok_s": hf_point.get("tok_s"),
                "hf_tpot_s": hf_point.get("tpot_s"),
            }
        )
    return rows


def print_limits(metrics: dict[str, Any], ceilings: dict[int, float]) -> None:
    machine = metrics["machine"]
    gemv = ", ".join(f"{name} {rate:.1f}" for name, rate in machine["gemv_gb_s"].items())
    gflops = ", ".join(f"{name} {rate:.1f}" for name, rate in machine["gflops"].items())
    print(
        f"\nmachine, measured in this run: a one-row matmul reads weights at {gemv} GB/s (a "
        f"plain float32 read {machine['read_gb_s']:.1f} GB/s); matmul {gflops} GFLOP/s; the "
        f"engine ran in {metrics['engine_dtype']}: a decode step reads "
        f"{metrics['decode_weight_mb']:.0f} MB of weights"
    )
    print(
        "ceiling (tokens/s): "
        + ", ".join(f"c{size} {value:.0f}" for size, value in sorted(ceilings.items()))
    )


def print_curve(curve: list[dict[str, Any]]) -> None:
    header = ("concurrency", "tok/s", "ceiling", "of ceiling", "TPOT p50", "TPOT p99", "HF tok/s")
    rows = [header]
    for point in curve:
        rows.append(
            (
                str(point["concurrency"]),
                fmt(point["tok_s"]),
                fmt(point["ceiling_tok_s"]),
                f"{point['fraction_of_ceiling']:.1%}",
                f"{point['tpot_p50_s'] * 1000:.1f} ms",
                f"{point['tpot_p99_s'] * 1000:.1f} ms",
                fmt(point["hf_tok_s"]),
            )
        )
    print()
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for index, row in enumerate(rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 prompts, 16 tokens")
    parser.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face baselines")
    parser.add_argument("--skip-llamacpp", action="store_true", help="skip llama.cpp")
    parser.add_argument("--output", type=Path, help="JSON path (default: bench/results/...)")
    parser.add_argument(
        "--hf-curve-max",
        type=int,
        default=max(CURVE_SIZES),
        help="the largest batch HF runs on the concurrency curve",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    config = QUICK if args.quick else FULL
    threads = cpu_count()
    torch.set_num_threads(threads)
    log(f"config: {config}, torch threads: {threads}")
    load_start = os.getloadavg()[0]
    if load_start > 0.5:
        # With one OpenMP thread per core, a busy core stalls every parallel op: small-batch
        # numbers can drop tenfold, so a busy machine's results are not comparable. (The load
        # average lags: it also counts work that ended in the last minute.)
        log(f"warning: 1-minute load average is {load_start:.2f}; results will be noisy")

    limits = measure_limits()
    log(f"machine: {limits}")
    tokenizer = Tokenizer(resolve_model_directory(MODEL))
    curve = config.curve
    prompts = curve_prompts(tokenizer, QUESTIONS, max(config.num_prompts, *curve))
    long_prompts = {kind: long_prompt(tokenizer, kind) for kind in LONG_PROMPT_QUESTIONS}

    # Engine first, freed (it goes out of scope in run_engine) before HF loads, so the
    # phases' memory peaks do not stack.
    engine_metrics, engine_outputs = run_engine(config, prompts, long_prompts, curve)
    gc.collect()
    release_freed_memory()
    int4_metrics = run_engine_int4(config, prompts)
    engine_metrics["details"].update(int4_metrics["details"])
    gc.collect()
    release_freed_memory()
    engine_metrics["details"]["peak_rss_after_engine_mb"] = peak_rss_mb()
    engine_metrics["details"]["rss_after_engine_freed_mb"] = current_rss_mb()
    hf_metrics = (
        {}
        if args.skip_hf
        else run_hf(config, prompts, long_prompts["cold"], engine_outputs, args.hf_curve_max)
    )
    llamacpp_metrics = (
        {} if args.skip_llamacpp else run_llamacpp(config, prompts, long_prompts, threads)
    )
    parameters = decode_parameters(resolve_model_directory(MODEL))
    dtype = engine_metrics["details"]["engine_dtype"]
    weight_bytes = parameters * DTYPE_BYTES[dtype]

    metrics: dict[str, Any] = {
        "engine_c32_tok_s": engine_metrics["engine_c32_tok_s"],
        "engine_c1_tok_s": engine_metrics["engine_c1_tok_s"],
        "engine_int4_c1_tok_s": int4_metrics["engine_int4_c1_tok_s"],
        "hf_batched_tok_s": hf_metrics.get("hf_batched_tok_s"),
        "hf_sequential_tok_s": hf_metrics.get("hf_sequential_tok_s"),
        "llamacpp_sequential_tok_s": llamacpp_metrics.get("llamacpp_sequential_tok_s"),
        "cold_ttft_s": engine_metrics["cold_ttft_s"],
        "warm_ttft_s": engine_metrics["warm_ttft_s"],
        "hf_prefill_s": hf_metrics.get("hf_prefill_s"),
        "warm_cached_tokens": engine_metrics["warm_cached_tokens"],
        "llamacpp_warm_ttft_s": llamacpp_metrics.get("llamacpp_warm_ttft_s"),
        "llamacpp_cold_ttft_s": llamacpp_metrics.get("llamacpp_cold_ttft_s"),
        "engine_c32_busy_tok_s": engine_metrics["engine_c32_busy_tok_s"],
        "hf_batched_busy_tok_s": hf_metrics.get("hf_batched_busy_tok_s"),
        "machine": limits.as_dict(),
        "engine_dtype": dtype,
        "decode_weight_mb": weight_bytes / 1e6,
    }
    ceilings = {
        size: ceiling_tok_s(
            size, weight_bytes, parameters, limits.gemv_gb_s[dtype], limits.gflops[dtype]
        )
        for size in sorted({1, config.num_prompts, *curve})
    }
    metrics["ceiling_c1_tok_s"] = ceilings[1]
    metrics["ceiling_c32_tok_s"] = ceilings[config.num_prompts]
    metrics["curve"] = curve_table(engine_metrics["curve"], hf_metrics.get("hf_curve"), ceilings)
    metrics["peak_rss_mb"] = peak_rss_mb()
    metrics["targets_met"] = {t.key: evaluate(t, metrics)[1] for t in TARGETS}
    metrics["details"] = {
        **engine_metrics["details"],
        **hf_metrics.get("details", {}),
        **llamacpp_metrics.get("details", {}),
    }
    metrics["config"] = {
        "mode": "quick" if args.quick else "full",
        **asdict(config),
        "model": MODEL,
        "torch_threads": threads,
        "loadavg_1m_start": load_start,
        "loadavg_1m_end": os.getloadavg()[0],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
    }

    print_table(metrics)
    print_limits(metrics, ceilings)
    print_curve(metrics["curve"])
    name = "engine-quick.json" if args.quick else "engine.json"
    write_json(metrics, args.output or RESULTS_DIR / name)
    print(json.dumps(metrics))


if __name__ == "__main__":
    main()
