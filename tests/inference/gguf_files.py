"""Write a tiny Hugging Face MoE model as a GGUF file, as llama.cpp's converter lays one out.

Qwen2-MoE (`qwen2moe`) and Qwen3-MoE (`qwen3moe`), the MoE architectures transformers' GGUF
loader reads, and Mixtral, which llama.cpp writes as `llama` and transformers then reads as a
dense Llama with no experts (so a loader has to refuse it). Tensors are F32, so a round trip
through transformers is exact. The names, the stacking of the routed experts, the metadata keys
and the q/k row permutation of `llama` files (Qwen uses NeoX rotary and has none) follow
llama.cpp's `convert_hf_to_gguf.py`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

# transformers `model_type` -> GGUF `general.architecture`
GGUF_MOE_ARCHITECTURES = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}

# Per-layer tensors, `model.layers.N.<hf>` -> `blk.N.<gguf>`.
_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_PROJECTIONS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}

_TOKEN_NORMAL, _TOKEN_CONTROL = 1, 3  # llama.cpp's gguf.TokenType values


def write_gguf(hf_dir: Path, path: Path) -> Path:
    """Write the model in `hf_dir` (config.json, float32 safetensors, a byte-level BPE
    tokenizer) to the GGUF file `path`, and return `path`."""
    import gguf
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(hf_dir))
    if config.model_type not in GGUF_MOE_ARCHITECTURES:
        raise ValueError(
            f"no GGUF layout for model_type {config.model_type!r}; "
            f"supported: {sorted(GGUF_MOE_ARCHITECTURES)}"
        )
    architecture = GGUF_MOE_ARCHITECTURES[config.model_type]
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(hf_dir.name)
    _add_model_metadata(writer, config)
    _add_tokenizer(writer, hf_dir)
    for name, tensor in _gguf_tensors(hf_dir).items():
        if architecture == "llama":
            tensor = _permute_for_llama_rope(name, tensor, config)
        # llama.cpp's converter squeezes every tensor: Qwen2-MoE's [1, hidden] shared-expert gate
        # is stored as [hidden], and transformers' reader adds the axis back.
        writer.add_tensor(name, np.ascontiguousarray(tensor.squeeze().numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_model_metadata(writer, config) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_expert_used_count(config.num_experts_per_tok)
    if config.model_type == "mixtral":
        writer.add_expert_count(config.num_local_experts)
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
        return
    writer.add_expert_count(config.num_experts)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if config.model_type == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    else:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)


def _permute_for_llama_rope(name: str, tensor: torch.Tensor, config) -> torch.Tensor:
    """llama.cpp's `LlamaModel.permute`: within each head, the rows of q and k go from
    half-split rotary pairs (HF) to interleaved ones (GGML's rope)."""
    if name.endswith("attn_q.weight"):
        heads = config.num_attention_heads
    elif name.endswith("attn_k.weight"):
        heads = config.num_key_value_heads
    else:
        return tensor
    rows = tensor.shape[0]
    return tensor.reshape(heads, 2, rows // heads // 2, -1).transpose(1, 2).reshape(tensor.shape)


def _add_tokenizer(writer, hf_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[token] for token in tokens] != list(range(len(tokens))):
        raise ValueError(f"the vocabulary of {hf_dir} does not number its tokens 0..n-1")
    tokenizer_json = json.loads((hf_dir / "tokenizer.json").read_text())
    # Every added token marked special (ChatML's <|im_start|> too, which is no named special
    # token) is CONTROL, so that transformers keeps it whole.
    special = {added["id"] for added in tokenizer_json["added_tokens"] if added["special"]}
    merges = tokenizer_json["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    # The tiny tokenizer splits words with GPT-2's regex, which is what llama.cpp calls "gpt-2"
    # and what transformers uses for a byte-level vocabulary with no split of its own.
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [_TOKEN_CONTROL if i in special else _TOKEN_NORMAL for i in range(len(tokens))]
    )
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)


def _gguf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    """The model's tensors under GGUF names, each layer's routed experts stacked into one
    [experts, out, in] tensor per projection."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                tensor = f.get_tensor(name).float()
                if name in _GLOBAL_TENSORS:
                    out[_GLOBAL_TENSORS[name]] = tensor
                    continue
                layer = _LAYER.fullmatch(name)
                if layer is None:
                    raise ValueError(f"no GGUF name for {name}")
                block, leaf = int(layer[1]), layer[2]
                expert = _EXPERT.fullmatch(leaf)
                if expert and expert[2] in _EXPERT_PROJECTIONS:
                    projection = _EXPERT_PROJECTIONS[expert[2]]
                    experts.setdefault((block, projection), {})[int(expert[1])] = tensor
                elif leaf in _LAYER_TENSORS:
                    out[f"blk.{block}.{_LAYER_TENSORS[leaf]}"] = tensor
                else:
                    raise ValueError(f"no GGUF name for {name}")
    for (block, projection), by_index in sorted(experts.items()):
        stacked = torch.stack([by_index[index] for index in sorted(by_index)])
        out[f"blk.{block}.ffn_{projection}_exps.weight"] = stacked
    return out
