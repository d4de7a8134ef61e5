"""Rotary position embedding, applied to query and key in place, in either layout.

- NeoX / Hugging Face layout (`interleaved=False`, what Llama checkpoints in HF format use):
  dimension i of a head pairs with dimension i + D/2 (`rotate_half`).
- GPT-J / original Meta Llama layout (`interleaved=True`): dimensions 2i and 2i + 1 pair.

Either way the pair turns by position × inv_freq[i]. Rope scalings for long contexts (linear,
llama3, yarn, ...) change only `inv_freq` and, for yarn, scale cos and sin
(`attention_scaling`): they live in the tables (`build_cos_sin_cache`), which are gathered once per
step (`rotary_cos_sin`) and shared by every layer. The Triton kernel rotates every head of one
token, query and key, in one program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.rounding import round_to


def build_cos_sin_cache(
    inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, rotary_dim / 2] in float32.

    `inv_freq` already includes any rope scaling (linear, llama3, yarn, ...); `attention_scaling`
    is the extra factor some scalings (yarn) apply to cos and sin.
    """
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq.to(torch.float32))
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling


def rotary_cos_sin(
    cos_cache: torch.Tensor, sin_cache: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token tables [T, 1, rotary_dim / 2] in `dtype` for `positions` [T]."""
    cos = cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
    sin = sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
    return cos, sin


def _pair_halves(x: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if interleaved:
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def rotary_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
) -> None:
    """Rotate query [T, Hq, D] and key [T, Hk, D] in place with per-token tables [T, 1, D/2].

    Works on the two members of each pair in place (x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin):
    the same roundings as Hugging Face's `x * cos + rotate_half(x) * sin`, with half the memory
    traffic.
    """
    for x in (query, key):
        x1, x2 = _pair_halves(x, interleaved)
        x1_sin = x1 * sin
        x1.mul_(cos).sub_(x2 * sin)
        x2.mul_(cos).add_(x1_sin)


@triton.jit
def _rotate_heads(
    x_ptr,
    token,
    stride_token,
    stride_head,
    num_heads,
    cos,
    sin,
    half,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    pairs = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (pairs < half)
    base = x_ptr + token * stride_token + heads * stride_head
    if INTERLEAVED:
        first = base + 2 * pairs
        second = first + 1
    else:
        first = base + pairs
        second = first + half
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(second, mask=mask, other=0.0)
    # Each product is rounded to the tensor's dtype before the sum, as the reference's in-place
    # `mul_`/`sub_` on bf16 tensors does, so both paths give the same bits.
    dtype = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    x1_cos = round_to(x1f * cos, dtype).to(tl.float32)
    x2_sin = round_to(x2f * sin, dtype).to(tl.float32)
    x2_cos = round_to(x2f * cos, dtype).to(tl.float32)
    x1_sin = round_to(x1f * sin, dtype).to(tl.float32)
    tl.store(first, round_to(x1_cos - x2_sin, dtype), mask=mask)
    tl.store(second, round_to(x2_cos + x1_sin, dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_table_token,
    num_q_heads,
    num_k_heads,
    half,
    INTERLEAVED: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pairs = tl.arange(0, BLOCK_HALF)[None, :]
    table_mask = pairs < half
    cos = tl.load(cos_ptr + token * stride_table_token + pairs, mask=table_mask, other=0.0)
    sin = tl.load(sin_ptr + token * stride_table_token + pairs, mask=table_mask, other=0.0)
    cos, sin = cos.to(tl.float32), sin.to(tl.float32)
    _rotate_heads(
        q_ptr, token, stride_q_token, stride_q_head, num_q_heads, cos, sin, half,
        INTERLEAVED, BLOCK_QH, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, token, stride_k_token, stride_k_head, num_k_heads, cos, sin, half,
        INTERLEAVED, BLOCK_KH, BLOCK_HALF,
    )  # fmt: skip


def rotary_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
) -> None:
    """Triton rotary with the same contract as `rotary_torch`. query and key may be strided
    views (the engine's are slices of the fused q|k|v projection); the head dim must be
    contiguous."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    if num_tokens == 0:
        return
    assert query.stride(-1) == 1 and key.stride(-1) == 1, "the head dim must be contiguous"
    half = head_dim // 2
    cos = cos.reshape(num_tokens, half).contiguous()
    sin = sin.reshape(num_tokens, half).contiguous()
    _rotary_kernel[(num_tokens,)](
        query,
        key,
        cos,
        sin,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos.stride(0),
        num_q_heads,
        num_k_heads,
        half,
        INTERLEAVED=interleaved,
        BLOCK_QH=triton.next_power_of_2(num_q_heads),
        BLOCK_KH=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
