"""The Triton rotary embedding against float64, in both layouts, with the tables of every rope
scaling the engine supports (computed by transformers' own initialisers, the oracle's), on strided
query/key views like the engine's."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kernels.rotary import build_cos_sin_cache, rotary_cos_sin, rotary_torch, rotary_triton
from tests.kernels.kernel_checks import assert_close_to_float64

MAX_POSITIONS = 8192
SCALINGS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
    },
}


def tables(scaling: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters=SCALINGS[scaling],
    )
    if scaling == "default":  # transformers has no initialiser for the unscaled case
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        return build_cos_sin_cache(inv_freq, MAX_POSITIONS)
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[scaling](config, "cpu")
    if scaling == "yarn":
        assert attention_scaling != 1.0  # the test below covers the scaled tables
    return build_cos_sin_cache(inv_freq, MAX_POSITIONS, float(attention_scaling))


def float64_rotation(x, cos, sin, interleaved: bool) -> torch.Tensor:
    """Rotate each pair as a complex number by the table's angle (cos, sin: [T, 1, D/2])."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    first, second = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    rotated = torch.complex(first, second) * torch.complex(cos, sin)
    if interleaved:
        return torch.stack([rotated.real, rotated.imag], dim=-1).flatten(-2)
    return torch.cat([rotated.real, rotated.imag], dim=-1)


def strided_query_key(tokens, heads, kv_heads, head_dim, dtype):
    """query and key as the engine has them: views into one fused q|k|v projection."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, dtype=dtype)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), qkv


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (13, 4, 4, 24), (5, 8, 1, 80), (3, 7, 7, 96)]
)
def test_it_matches_float64(interleaved, scaling, dtype, tokens, heads, kv_heads, head_dim):
    cos_cache, sin_cache = tables(scaling, head_dim)
    positions = torch.randint(0, MAX_POSITIONS, (tokens,))
    cos, sin = rotary_cos_sin(cos_cache, sin_cache, positions, dtype)
    q, k, qkv = strided_query_key(tokens, heads, kv_heads, head_dim, dtype)
    q0, k0, qkv0 = q.clone(), k.clone(), qkv.clone()
    rotary_triton(q, k, cos, sin, interleaved)
    # The expected values use the same (float32-built, dtype-rounded) tables: the kernel's job is
    # the rotation; the tables' own accuracy is the reference module's.
    assert_close_to_float64(q, float64_rotation(q0, cos, sin, interleaved), dtype)
    assert_close_to_float64(k, float64_rotation(k0, cos, sin, interleaved), dtype)
    # Only query and key turned: the values beside them in the fused projection are untouched.
    v_start = (heads + kv_heads) * head_dim
    assert torch.equal(qkv[:, v_start:], qkv0[:, v_start:])


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_it_gives_the_references_bits(interleaved, dtype):
    """The kernel rounds each product where the reference's in-place ops round, so the engine's
    tokens do not depend on the backend."""
    cos_cache, sin_cache = tables("llama3", 64)
    positions = torch.randint(0, MAX_POSITIONS, (17,))
    cos, sin = rotary_cos_sin(cos_cache, sin_cache, positions, dtype)
    q, k, _ = strided_query_key(17, 9, 3, 64, dtype)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_triton(q, k, cos, sin, interleaved)
    rotary_torch(q_ref, k_ref, cos, sin, interleaved)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def test_the_two_layouts_differ():
    """Guards the layout parameter: with it ignored, one of the layout tests above fails."""
    cos, sin = rotary_cos_sin(*tables("default", 64), torch.tensor([7, 300]), torch.float32)
    q, k, _ = strided_query_key(2, 2, 1, 64, torch.float32)
    q2, k2 = q.clone(), k.clone()
    rotary_triton(q, k, cos, sin, False)
    rotary_triton(q2, k2, cos, sin, True)
    assert (q - q2).abs().max() > 1e-2
