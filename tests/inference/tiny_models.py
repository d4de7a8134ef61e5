"""Tiny random-weight Llama-family models, built by the tests themselves (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import (
    DeepseekV3Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Prefix caching lets agents reuse long prompts across turns.",
    "Continuous batching admits new requests while others decode.",
    "Héllo wörld, naïve café! Ünïcödé ✓ 日本語のテキスト 🚀🔥",
    "def add(a, b):\n    return a + b\n",
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ?",
]


def build_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a few sentences, with ChatML special tokens."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(CORPUS * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    return tokenizer


# The sparse and MLA families, each with the options that bite (MOE_ARCHITECTURES).
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}
MOE_ARCHITECTURES = ("mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v3", "deepseek-v3-qlora")


def _moe_config(architecture: str, common: dict):
    """The config of a tiny sparse model: 8 experts, 2 per token."""
    moe = dict(common, num_experts_per_tok=2)
    if architecture == "mixtral":
        return MixtralConfig(**moe, num_local_experts=8, tie_word_embeddings=False)
    if architecture == "qwen2-moe":
        return Qwen2MoeConfig(
            **moe,
            num_experts=8,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            tie_word_embeddings=False,
        )
    if architecture == "qwen3-moe":
        return Qwen3MoeConfig(
            **moe, num_experts=8, moe_intermediate_size=48, head_dim=24, norm_topk_prob=True
        )
    # DeepSeek-V3 (Kimi K2's architecture): MLA, one dense layer first, grouped sigmoid routing
    # over 4 groups of 2 experts with the correction bias, shared expert, YaRN.
    return DeepseekV3Config(
        **dict(moe, num_key_value_heads=4),
        n_routed_experts=8,
        n_shared_experts=1,
        moe_intermediate_size=48,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=32 if architecture == "deepseek-v3-qlora" else None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_parameters=DEEPSEEK_YARN,
        tie_word_embeddings=False,
    )


def build_tiny_model(directory: Path, architecture: str = "llama", seed: int = 0) -> Path:
    """Save a random-weight model of `architecture` with a tokenizer: llama, llama3-rope (Llama
    with Llama 3.1 rope scaling), yarn-rope, mistral, qwen2, qwen3, or one of
    MOE_ARCHITECTURES. DeepSeek-V3's correction bias, zero in transformers' initialisation, is
    randomised so that it changes which experts are chosen."""
    from transformers import AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        # Larger than the default 0.02 so that logits are peaked and greedy choices are not
        # decided by rounding.
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if architecture == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=False)
    elif architecture == "llama3-rope":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        config = LlamaConfig(**common, tie_word_embeddings=False, rope_parameters=rope)
    elif architecture == "yarn-rope":
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
        }
        config = Qwen2Config(**common, tie_word_embeddings=False, rope_parameters=rope)
    elif architecture == "mistral":
        config = MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    elif architecture == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=True)
    elif architecture == "qwen3":
        config = Qwen3Config(**common, head_dim=24, tie_word_embeddings=False)
    elif architecture in MOE_ARCHITECTURES:
        config = _moe_config(architecture, common)
    else:
        raise ValueError(architecture)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.rand_like(buffer) * 0.5)
    model.save_pretrained(str(directory))
    return directory
