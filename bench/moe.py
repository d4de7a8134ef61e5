"""MoE benchmark: the engine serving DeepSeek-V3's architecture (MLA + MoE) against HF `generate()`.

Builds, in the run, a random-weight DeepSeek-V3 model (transformers' `DeepseekV3Config`, saved
as a Hugging Face directory in a temporary directory with a word-level tokenizer that covers
its vocabulary; nothing is downloaded): Multi-head Latent Attention with a LoRA'd query, one
dense layer first, then sparse layers of grouped sigmoid routing (with a random correction
bias) over 32 routed experts, 6 per token, and a shared expert; YaRN rope. `--config small` (the
default) has about 370 M parameters, `--config smoke` is a tiny one for a quick check. The
engine and HF both run in `--dtype` (bfloat16 where the CPU runs it natively, else float32) with
one torch thread per core, on the same random prompts (`--prompt-tokens`, default 1024),
greedy, `--new-tokens` each (64), and
it measures, as generated tokens per wall-clock second (prefill included), after a warm-up:

- `engine_c1_tok_s` / `hf_c1_tok_s`: the first prompts one at a time;
- `engine_c16_tok_s` / `hf_batched_tok_s`: 16 prompts at once (for HF one left-padded batch
  with its attention mask; the prompts have one length, so HF computes no padding);
- `kv_bytes_per_token_mla` / `kv_bytes_per_token_mha`: what the engine's latent cache holds
  per token over all layers, against per-head keys and values (`ModelConfig`), for this model
  and for DeepSeek-V3's own shapes (`deepseek_v3_...`, a config without weights); the ratio
  must equal H·(Dqk + Dv) / (R + P);
- the split of one engine decode step at 16 concurrent (after the measurements above, on new
  requests): router (its matmul and top-k), routed experts (`fused_moe`), shared expert, MLA
  attention, and the rest (embedding, norms, the dense layer, LM head, sampling, scheduling),
  from `torch.profiler` ranges that the bench adds around the model's calls (the engine's code
  is not changed); the profiler's own cost falls in "rest", so the unprofiled step time is
  reported beside it.

It prints the model, a table (metric, value, baseline, ratio, target, met), the step split and,
as the last line of stdout, one JSON object, also written to bench/results/moe.json
(moe-smoke.json with `--config smoke`; `--out` for another path). Progress goes to stderr.

    .venv/bin/python bench/moe.py                   # full run (a few minutes on 2 idle cores)
    .venv/bin/python bench/moe.py --config smoke    # tiny model, about 30 s
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import random
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

# `python bench/moe.py` puts bench/ on sys.path, not the repository root.
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import kernels  # noqa: E402
from bench.engine import (  # noqa: E402
    Target,
    Throughput,
    check_lengths,
    common_prefix,
    cpu_count,
    engine_generate,
    engine_sequential,
    evaluate,
    fmt,
    greedy,
    log,
    timed,
    write_json,
)
from inference.engine import LLM  # noqa: E402
from inference.engine.llm_engine import LLMEngine  # noqa: E402
from inference.models import moe as moe_module  # noqa: E402
from inference.models.decoder import DecoderModel  # noqa: E402
from inference.models.model_config import ModelConfig  # noqa: E402
from inference.models.moe import SparseMoE  # noqa: E402

RESULTS_DIR = REPO_ROOT / "bench" / "results"
CONCURRENCY = 16
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
EOS_TOKEN = 0  # also the padding token
FIRST_ORDINARY_TOKEN = 2  # after <eos> and <unk>; random prompts use the ids above
WARMUP_DECODE_STEPS = 2

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}
# What every configuration shares with DeepSeek-V3: one dense layer first, one shared expert,
# its routing options, YaRN. A larger initializer range than the default 0.02 makes the random
# model's logits peaked, so that greedy outputs are not decided by rounding alone.
COMMON_MODEL = dict(
    first_k_dense_replace=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    rope_parameters=YARN,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    initializer_range=0.05,
    tie_word_embeddings=False,
    bos_token_id=EOS_TOKEN,
    eos_token_id=EOS_TOKEN,
    pad_token_id=EOS_TOKEN,
)


@dataclass(frozen=True)
class RunConfig:
    """A model shape (DeepseekV3Config keywords beside COMMON_MODEL) and measurement sizes."""

    model: dict[str, Any]
    prompt_tokens: int
    new_tokens: int
    c1_prompts: int  # prompts served one at a time, by the engine and by HF
    profile_steps: int  # decode steps timed, then profiled, for the step split


CONFIGS = {
    "small": RunConfig(
        model=dict(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=384,
            kv_lora_rank=256,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            n_routed_experts=32,
            moe_intermediate_size=384,
            num_experts_per_tok=6,
            n_group=4,
            topk_group=2,
        ),
        # An agent-sized prompt (the workload Hearth serves); `--prompt-tokens 128` is the short
        # case docs/performance.md records beside it.
        prompt_tokens=1024,
        new_tokens=64,
        c1_prompts=3,
        profile_steps=8,
    ),
    "smoke": RunConfig(
        model=dict(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            moe_intermediate_size=64,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
        ),
        prompt_tokens=32,
        new_tokens=8,
        c1_prompts=1,
        profile_steps=2,
    ),
}

# DeepSeek-V3's own attention shapes (its config.json), for the KV figures only: no weights.
DEEPSEEK_V3_SHAPES = dict(
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    hidden_size=7168,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    max_position_embeddings=163840,
    rope_parameters=dict(YARN, factor=40.0, original_max_position_embeddings=4096),
)

TARGETS = (
    Target("c16_vs_hf_batched", "engine_c16_tok_s", "hf_batched_tok_s", 3.0, True),
    Target("c1_vs_hf_c1", "engine_c1_tok_s", "hf_c1_tok_s", 1.5, True),
)
STEP_COMPONENTS = ("router", "routed_experts", "shared_experts", "attention", "rest")
# The MoE's kernel calls, by the profiler range they are counted in.
MOE_KERNEL_LABELS = {"linear": "router", "select_experts": "router", "fused_moe": "routed_experts"}


# ---- the model ------------------------------------------------------------------------------
def save_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one word per id: the engine loads a tokenizer from the model
    directory and detokenizes every generated token, so every id must decode to text, as with
    a real vocabulary."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": EOS_TOKEN, "<unk>": 1}
    vocab.update({f"w{i}": i for i in range(FIRST_ORDINARY_TOKEN, vocab_size)})
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(str(directory))


def build_model(directory: Path, shape: dict[str, Any], dtype: torch.dtype, seed: int) -> Any:
    """Save a random-weight DeepSeek-V3 model of `shape` with its tokenizer to `directory`;
    return the HF model (in `dtype`), which serves as the baseline. The correction bias, zero in
    transformers' initialisation, is randomised so that it changes which experts are chosen."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(**COMMON_MODEL, **shape)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.rand_like(buffer) * 0.5)
    model.save_pretrained(str(directory))
    save_tokenizer(directory, config.vocab_size)
    return model


def parameter_counts(model: Any) -> dict[str, int]:
    """All parameters, and those one token uses: all but the routed experts it is not sent to
    (embedding and LM head included, as DeepSeek-V3's "37 B active" counts them)."""
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    routed = sum(
        p.numel()
        for layer in model.model.layers
        if hasattr(layer.mlp, "experts")
        for p in layer.mlp.experts.parameters()
    )
    unused_share = Fraction(
        config.n_routed_experts - config.num_experts_per_tok, config.n_routed_experts
    )
    return {
        "params": total,
        "active_params_per_token": total - int(routed * unused_share),
        "routed_expert_params": routed,
        "embedding_params": model.model.embed_tokens.weight.numel(),
    }


def describe(name: str, shape: dict[str, Any], params: dict[str, int]) -> None:
    print(f"model ({name}): DeepSeek-V3 architecture, random weights")
    print("  " + ", ".join(f"{key}={value}" for key, value in shape.items()))
    yarn = f"YaRN factor {YARN['factor']:g}, mscale_all_dim {YARN['mscale_all_dim']:g}"
    print(f"  first_k_dense_replace=1, n_shared_experts=1, {yarn}")
    print(
        f"  parameters: {params['params'] / 1e6:.1f} M total, "
        f"{params['active_params_per_token'] / 1e6:.1f} M active per token "
        f"(routed experts {params['routed_expert_params'] / 1e6:.1f} M)"
    )


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(length)]
        for _ in range(count)
    ]


# ---- KV bytes per token ---------------------------------------------------------------------
def kv_figures(config: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The latent cache's bytes per token against per-head keys and values, and the ratio the
    shapes predict: H·(Dqk + Dv) values per layer against R + P (layers and bytes cancel)."""
    mla = config.mla
    mla_bytes = config.kv_bytes_per_token(dtype)
    mha_bytes = config.mha_kv_bytes_per_token(dtype)
    ratio = Fraction(mha_bytes, mla_bytes)
    formula = Fraction(
        config.num_heads * (mla.qk_head_dim + mla.v_head_dim),
        mla.kv_lora_rank + mla.qk_rope_head_dim,
    )
    return {
        "mla": mla_bytes,
        "mha": mha_bytes,
        "ratio": float(ratio),
        "formula_ratio": float(formula),
        "equal": ratio == formula,
    }


def deepseek_v3_model_config() -> ModelConfig:
    from transformers import DeepseekV3Config

    return ModelConfig.from_hf(DeepseekV3Config(**DEEPSEEK_V3_SHAPES))


# ---- our engine -----------------------------------------------------------------------------
def run_engine(
    llm: LLM, run: RunConfig, prompts: list[list[int]]
) -> tuple[dict[str, Any], list[list[int]]]:
    """One stream, then 16 at once; returns metrics and the one-stream outputs."""
    # Warm-up: first-call costs (allocator, oneDNN kernel selection) of both batch shapes.
    engine_generate(llm, prompts, 2, namespace="warmup-c16")
    engine_generate(llm, prompts[:1], 2, namespace="warmup-c1")
    # A namespace per run, so no run hits blocks cached by an earlier one.
    c1, c1_tokens = engine_sequential(llm, prompts[: run.c1_prompts], run.new_tokens, "c1-run")
    log(f"engine c1: {c1.tokens} tokens in {c1.seconds:.2f}s")
    c16, _ = engine_generate(llm, prompts, run.new_tokens, namespace="c16-run")
    log(f"engine c{CONCURRENCY}: {c16.tokens} tokens in {c16.seconds:.2f}s")
    metrics = {
        "engine_c1_tok_s": c1.tok_s,
        "engine_c16_tok_s": c16.tok_s,
        "details": {"engine_c1": asdict(c1), "engine_c16": asdict(c16)},
    }
    return metrics, c1_tokens


# ---- Hugging Face ---------------------------------------------------------------------------
def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids padded on the left (decoder-only batching) and their attention mask."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), EOS_TOKEN, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


def hf_generate(
    model: Any, prompts: list[list[int]], new_tokens: int
) -> tuple[Throughput, list[list[int]]]:
    """One static batch through `model.generate`, greedy, exactly `new_tokens` each."""
    input_ids, attention_mask = left_pad(prompts)
    with torch.inference_mode():
        out, seconds = timed(
            lambda: model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                min_new_tokens=new_tokens,
                max_new_tokens=new_tokens,
                pad_token_id=EOS_TOKEN,
            )
        )
    generated = out[:, input_ids.shape[1] :].tolist()
    check_lengths("hf", generated, new_tokens)
    return Throughput(len(generated) * new_tokens, seconds), generated


def run_hf(
    model: Any, run: RunConfig, prompts: list[list[int]], engine_outputs: list[list[int]]
) -> dict[str, Any]:
    """HF baselines in the engine's dtype; `engine_outputs` (the engine's one-stream run) are
    compared with HF's greedy outputs for the same prompts as a check of the engine's numerics."""
    hf_generate(model, prompts, 2)  # warm-up, as for the engine
    hf_generate(model, prompts[:1], 2)
    runs = [hf_generate(model, [p], run.new_tokens) for p in prompts[: run.c1_prompts]]
    c1 = Throughput(sum(r.tokens for r, _ in runs), sum(r.seconds for r, _ in runs))
    log(f"HF c1: {c1.tokens} tokens in {c1.seconds:.2f}s")
    batched, _ = hf_generate(model, prompts, run.new_tokens)
    log(f"HF batched {len(prompts)}: {batched.tokens} tokens in {batched.seconds:.2f}s")
    return {
        "hf_c1_tok_s": c1.tok_s,
        "hf_batched_tok_s": batched.tok_s,
        "details": {
            "hf_c1": asdict(c1),
            "hf_batched": asdict(batched),
            "hf_attn_implementation": model.config._attn_implementation,
            "hf_experts_implementation": getattr(model.config, "_experts_implementation", None),
            # Leading tokens on which the engine's and HF's greedy outputs agree; rounding in
            # low precision makes late divergence normal, very early divergence suspicious.
            "engine_vs_hf_agreeing_prefix": [
                common_prefix(e, h) for e, (_, (h,)) in zip(engine_outputs, runs, strict=True)
            ],
        },
    }


# ---- the decode step's split ----------------------------------------------------------------
def labelled(function: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return function(*args, **kwargs)

    return call


class LabelledKernels:
    """`kernels` as inference/models/moe.py sees it while the step is profiled: the router's
    matmul and top-k, and the routed experts, each inside a profiler range. (In a DeepSeek-V3
    layer the MoE's only `linear` is the router's.)"""

    def __getattr__(self, name: str) -> Any:
        function = getattr(kernels, name)
        label = MOE_KERNEL_LABELS.get(name)
        return labelled(function, label) if label else function


@contextlib.contextmanager
def component_ranges(model: DecoderModel) -> Iterator[None]:
    """Profiler ranges around each layer's attention and shared expert (on the instances) and
    the MoE's kernel calls (the moe module's `kernels`), removed on exit."""
    wrapped: list[tuple[Any, str]] = []
    for layer in model.layers:
        wrapped.append((layer.attention, "attention"))
        if isinstance(layer.mlp, SparseMoE) and layer.mlp.shared is not None:
            wrapped.append((layer.mlp.shared, "shared_experts"))
    for component, label in wrapped:
        component.forward = labelled(component.forward, label)
    original_ops = moe_module.ops
    moe_module.ops = LabelledKernels()
    try:
        yield
    finally:
        moe_module.ops = original_ops
        for component, _ in wrapped:
            del component.forward  # the class's method again


def decode_step(engine: LLMEngine, concurrency: int) -> None:
    outputs = engine.step()
    if len(outputs) != concurrency or any(len(o.token_ids) != 1 for o in outputs):
        raise RuntimeError(f"expected a decode step of {concurrency} sequences, got {outputs}")


def experts_touched(sparse_layers: list[SparseMoE], before: torch.Tensor) -> float:
    """Distinct routed experts that received a token since `before`, per sparse layer (mean)."""
    after = torch.stack([mlp.expert_tokens for mlp in sparse_layers])
    return float((after - before > 0).sum(dim=1).float().mean())


def profile_decode_steps(llm: LLM, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """Time `steps` decode steps of `len(prompts)` sequences, then profile as many more with
    ranges around the model's components."""
    engine = llm.engine
    model = engine.runner.model
    sparse_layers = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    # One token from prefill, the warm-up and measured steps, and one more so that no measured
    # step also finishes the requests; plus a token per step the prefills may take (chunked,
    # a prompt prefilled early decodes while the others are still prefilling).
    budget = engine.config.max_num_batched_tokens
    prefill_steps = -(-sum(len(prompt) for prompt in prompts) // budget) + len(prompts)
    max_tokens = 1 + WARMUP_DECODE_STEPS + 2 * steps + 1 + prefill_steps
    for index, prompt in enumerate(prompts):
        engine.add_request(f"profile-{index}", prompt, greedy(max_tokens), namespace="profile")
    prefilled: set[str] = set()
    while len(prefilled) < len(prompts):
        prefilled.update(o.request_id for o in engine.step() if o.token_ids)
    for _ in range(WARMUP_DECODE_STEPS):
        decode_step(engine, len(prompts))

    _, plain_s = timed(lambda: [decode_step(engine, len(prompts)) for _ in range(steps)])

    touched: list[float] = []
    with component_ranges(model), profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(steps):
            before = torch.stack([mlp.expert_tokens for mlp in sparse_layers])
            with record_function("step"):
                decode_step(engine, len(prompts))
            touched.append(experts_touched(sparse_layers, before))
    while engine.has_unfinished_requests():
        engine.step()

    totals_us = {event.key: event.cpu_time_total for event in profiler.key_averages()}
    per_step_ms = {label: totals_us.get(label, 0.0) / 1000 / steps for label in STEP_COMPONENTS}
    profiled_step_ms = totals_us["step"] / 1000 / steps
    per_step_ms["rest"] = profiled_step_ms - sum(
        ms for label, ms in per_step_ms.items() if label != "rest"
    )
    return {
        "decode_step_ms": plain_s * 1000 / steps,
        "profiled_step_ms": profiled_step_ms,
        "step_split_ms": per_step_ms,
        "step_split_fraction": {k: v / profiled_step_ms for k, v in per_step_ms.items()},
        "routed_experts_touched_per_layer": sum(touched) / len(touched),
        "profiled_steps": steps,
    }


def step_weight_bytes(
    params: dict[str, int], num_experts: int, touched: float, element_bytes: int
) -> int:
    """Weight bytes a decode step reads when `touched` of the `num_experts` routed experts of
    each sparse layer received tokens: every other weight but the embedding (of which a step
    reads only its tokens' rows), and those experts."""
    other = params["params"] - params["routed_expert_params"] - params["embedding_params"]
    return int((other + params["routed_expert_params"] * touched / num_experts) * element_bytes)


# ---- report ---------------------------------------------------------------------------------
def print_table(metrics: dict[str, Any], kv: dict[str, dict[str, Any]]) -> None:
    header = ("metric", "value", "baseline", "ratio", "target", "met")
    rows = [header]
    for target in TARGETS:
        ratio, met = evaluate(target, metrics)
        baseline = f"{target.baseline}={fmt(metrics.get(target.baseline))}"
        met_text = "n/a" if met is None else "yes" if met else "no"
        rows.append(
            (
                target.metric,
                fmt(metrics.get(target.metric)),
                baseline,
                fmt(ratio),
                f">= {target.factor:g}x",
                met_text,
            )
        )
    for prefix, figures in kv.items():
        rows.append(
            (
                f"{prefix}kv_bytes_per_token_mla",
                f"{figures['mla']:,}",
                f"{prefix}kv_bytes_per_token_mha={figures['mha']:,}",
                f"1/{figures['ratio']:.4g}",
                f"= 1/{figures['formula_ratio']:.4g} (H(Dqk+Dv)/(R+P))",
                "yes" if figures["equal"] else "no",
            )
        )
    print_rows(rows)


def print_split(split: dict[str, Any]) -> None:
    print(
        f"decode step at c{CONCURRENCY}: {split['decode_step_ms']:.2f} ms "
        f"({split['profiled_step_ms']:.2f} ms profiled), "
        f"{split['routed_experts_touched_per_layer']:.1f} routed experts touched per layer"
    )
    rows = [("component", "ms/step", "share")]
    for label in STEP_COMPONENTS:
        ms, share = split["step_split_ms"][label], split["step_split_fraction"][label]
        rows.append((label, f"{ms:.2f}", f"{share:.1%}"))
    print_rows(rows)


def print_rows(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for index, row in enumerate(rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def native_dtype() -> str:
    """bfloat16 on a CPU whose oneDNN runs it natively; float32 elsewhere, where bf16 matrix
    products fall back to a path several times slower than float32's (an AVX2-only CPU)."""
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return "bfloat16" if native else "float32"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small", help="model size")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=native_dtype(),
        help="default: bfloat16 where oneDNN runs bf16 natively (AVX-512 BF16/AMX), else float32",
    )
    parser.add_argument("--prompt-tokens", type=int, help="prompt length (default: the config's)")
    parser.add_argument("--new-tokens", type=int, help="tokens generated per prompt")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts")
    parser.add_argument("--out", type=Path, help="JSON path (default: bench/results/...)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    run = CONFIGS[args.config]
    run = replace(
        run,
        prompt_tokens=args.prompt_tokens or run.prompt_tokens,
        new_tokens=args.new_tokens or run.new_tokens,
    )
    dtype = DTYPES[args.dtype]
    threads = cpu_count()
    torch.set_num_threads(threads)
    log(f"config {args.config}: {run}, dtype {args.dtype}, torch threads: {threads}")
    load_start = os.getloadavg()[0]
    if load_start > 0.5:
        # One OpenMP thread per core: a busy core stalls every parallel op (bench/engine.py).
        log(f"warning: 1-minute load average is {load_start:.2f}; results will be noisy")

    with tempfile.TemporaryDirectory(prefix="hearth-moe-") as tmp:
        directory = Path(tmp)
        hf_model, build_s = timed(lambda: build_model(directory, run.model, dtype, args.seed))
        log(f"random model built and saved in {build_s:.1f}s")
        params = parameter_counts(hf_model)
        describe(args.config, run.model, params)
        prompts = random_prompts(CONCURRENCY, run.prompt_tokens, run.model["vocab_size"], args.seed)
        llm, load_s = timed(lambda: LLM(str(directory), dtype=args.dtype))
        log(f"engine loaded in {load_s:.1f}s")

    engine_metrics, engine_outputs = run_engine(llm, run, prompts)
    hf_metrics = run_hf(hf_model, run, prompts, engine_outputs)
    del hf_model
    split = profile_decode_steps(llm, prompts, run.profile_steps)
    model = llm.engine.runner.model
    kv = {
        "": kv_figures(model.config, dtype),
        "deepseek_v3_": kv_figures(deepseek_v3_model_config(), torch.bfloat16),
    }
    # Weight bytes read per second: gpt-fast's "bandwidth achieved", for one stream (a token
    # reads its top-k experts; the tokens/s include the prefill) and for a decode step at 16
    # concurrent (which reads every expert that one of its tokens chose).
    element = torch.empty((), dtype=dtype).element_size()
    num_experts = model.config.moe.num_experts
    c1_token_bytes = step_weight_bytes(params, num_experts, model.config.moe.top_k, element)
    c16_step_bytes = step_weight_bytes(
        params, num_experts, split["routed_experts_touched_per_layer"], element
    )

    metrics: dict[str, Any] = {
        "engine_c1_tok_s": engine_metrics["engine_c1_tok_s"],
        "hf_c1_tok_s": hf_metrics["hf_c1_tok_s"],
        "engine_c16_tok_s": engine_metrics["engine_c16_tok_s"],
        "hf_batched_tok_s": hf_metrics["hf_batched_tok_s"],
        "kv_bytes_per_token_mla": kv[""]["mla"],
        "kv_bytes_per_token_mha": kv[""]["mha"],
        "kv_ratio": kv[""]["ratio"],
        "kv_formula_ratio": kv[""]["formula_ratio"],
        "deepseek_v3_kv_bytes_per_token_mla": kv["deepseek_v3_"]["mla"],
        "deepseek_v3_kv_bytes_per_token_mha": kv["deepseek_v3_"]["mha"],
        "deepseek_v3_kv_ratio": kv["deepseek_v3_"]["ratio"],
        "decode_step_ms": split["decode_step_ms"],
        "step_split_ms": split["step_split_ms"],
        "step_split_fraction": split["step_split_fraction"],
        **params,
    }
    metrics["targets_met"] = {t.key: evaluate(t, metrics)[1] for t in TARGETS}
    metrics["targets_met"]["kv_ratio_equals_formula"] = all(f["equal"] for f in kv.values())
    metrics["details"] = {
        **engine_metrics["details"],
        **hf_metrics["details"],
        "build_s": build_s,
        "engine_load_s": load_s,
        "profiled_step_ms": split["profiled_step_ms"],
        "profiled_steps": split["profiled_steps"],
        "routed_experts_touched_per_layer": split["routed_experts_touched_per_layer"],
        "c1_token_weight_bytes": c1_token_bytes,
        "engine_c1_weight_gb_s": c1_token_bytes * engine_metrics["engine_c1_tok_s"] / 1e9,
        "c16_step_weight_bytes": c16_step_bytes,
        "c16_step_weight_gb_s": c16_step_bytes / split["decode_step_ms"] / 1e6,
    }
    metrics["config"] = {
        "name": args.config,
        "dtype": args.dtype,
        "threads": threads,
        "model": run.model,
        "prompt_tokens": run.prompt_tokens,
        "new_tokens": run.new_tokens,
        "concurrency": CONCURRENCY,
        "c1_prompts": run.c1_prompts,
        "seed": args.seed,
        "loadavg_1m_start": load_start,
        "loadavg_1m_end": os.getloadavg()[0],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
    }

    print_table(metrics, kv)
    print_split(split)
    name = "moe.json" if args.config == "small" else f"moe-{args.config}.json"
    write_json(metrics, args.out or RESULTS_DIR / name)
    print(json.dumps(metrics))


if __name__ == "__main__":
    main()
