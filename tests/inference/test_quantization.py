"""Dequantizing fp8 block-wise (DeepSeek-V3, Kimi K2) and compressed-tensors pack-quantized int4
(Kimi K2.5) checkpoints, against float64 references written out here on fresh random inputs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, DeepseekV3Config

from inference.errors import ModelLoadError
from inference.models.quantization import (
    dequantize_checkpoint,
    dequantize_fp8_blockwise,
    dequantize_pack_quantized,
)
from tests.inference.quantized_checkpoints import (
    FP8_QUANTIZATION_CONFIG,
    INT4_QUANTIZATION_CONFIG,
    dequantized_copy,
    is_fp8_projection,
    is_routed_expert,
    pack_int32,
    quantize_fp8_blockwise,
    quantize_int4_groups,
    write_fp8_checkpoint,
    write_int4_experts_checkpoint,
)
from tests.inference.tiny_models import build_tokenizer


def random_fp8(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """fp8 values across e4m3's whole range, subnormals and ±448 included."""
    magnitude = torch.exp2(torch.rand(rows, cols, generator=generator) * 20 - 11)
    sign = torch.randint(0, 2, (rows, cols), generator=generator) * 2 - 1
    return (sign * magnitude).clamp(-448, 448).to(torch.float8_e4m3fn)


def fp8_reference(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
    """W[n, k] = weight[n, k] * scale_inv[n // bn, k // bk] in float64, by explicit indexing."""
    rows = torch.arange(weight.shape[0])[:, None] // block[0]
    cols = torch.arange(weight.shape[1])[None, :] // block[1]
    return weight.double() * scale_inv.double()[rows, cols]


@pytest.mark.parametrize(
    "shape, block",
    [((300, 200), (128, 128)), ((128, 384), (128, 128)), ((64, 64), (128, 128)), ((5, 9), (4, 2))],
)
def test_fp8_blockwise_matches_a_float64_reference(shape, block):
    generator = torch.Generator().manual_seed(sum(shape))
    weight = random_fp8(*shape, generator)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scale_inv = torch.rand(grid, generator=generator) * 1e-2 + 1e-4
    expected = fp8_reference(weight, scale_inv, block)

    # float32: fp8 (4 significant bits) times a float32 scale is rounded once, like the reference.
    out32 = dequantize_fp8_blockwise(weight, scale_inv, block, dtype=torch.float32)
    assert out32.dtype == torch.float32
    assert torch.equal(out32, expected.float())
    # bfloat16: rounded through float32 first, so within one bf16 ulp (2^-7 relative).
    out16 = dequantize_fp8_blockwise(weight, scale_inv, block, dtype=torch.bfloat16)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.double(), expected, rtol=2**-7, atol=0)


def test_fp8_blockwise_refuses_scales_of_the_wrong_grid():
    weight = torch.zeros(300, 200, dtype=torch.float8_e4m3fn)
    with pytest.raises(ModelLoadError, match=r"needs scales of shape \(3, 2\)"):
        dequantize_fp8_blockwise(weight, torch.ones(2, 2))


def test_fp8_round_trip_stays_within_e4m3_rounding():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 200, generator=generator)
    quantized, scale_inv = quantize_fp8_blockwise(weight)
    assert quantized.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2)
    restored = dequantize_fp8_blockwise(quantized, scale_inv, dtype=torch.float32)
    # e4m3 keeps 3 fraction bits (relative error 2^-4) down to 2^-6 of the scale, below which
    # the step is 2^-9 of the scale.
    scale = fp8_reference(torch.ones(300, 200), scale_inv, (128, 128)).float()
    bound = torch.maximum(weight.abs() * 2**-4, scale * 2**-10)
    assert ((restored - weight).abs() <= bound).all()


def pack_quantized_reference(values, scale, group_size, zero_point=None):
    """W[n, k] = (q[n, k] - z[n, k // g]) * s[n, k // g] in float64, by explicit indexing."""
    groups = torch.arange(values.shape[1]) // group_size
    shifted = values.double()
    if zero_point is not None:
        shifted = shifted - zero_point.double()[:, groups]
    return shifted * scale.double()[:, groups]


@pytest.mark.parametrize(
    "num_bits, rows, cols, group_size",
    [(4, 7, 64, 32), (4, 33, 256, 32), (4, 5, 20, 32), (4, 6, 48, 32), (8, 9, 96, 32)],
)
def test_pack_quantized_matches_a_float64_reference(num_bits, rows, cols, group_size):
    generator = torch.Generator().manual_seed(rows * cols)
    low, high = -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1
    values = torch.randint(low, high + 1, (rows, cols), generator=generator)
    groups = -(-cols // group_size)
    scale = (torch.rand(rows, groups, generator=generator) * 0.1 + 1e-3).to(torch.bfloat16)
    packed = pack_int32(values, num_bits)
    assert packed.shape == (rows, -(-cols // (32 // num_bits)))
    expected = pack_quantized_reference(values, scale, group_size)

    # A value of at most 8 bits times a bf16 scale is exact in float32, so one rounding to the
    # output dtype: both dtypes match the reference exactly.
    for dtype in (torch.float32, torch.bfloat16):
        out = dequantize_pack_quantized(
            packed, scale, torch.tensor([rows, cols]), group_size, num_bits, dtype=dtype
        )
        assert out.dtype == dtype
        assert torch.equal(out, expected.to(dtype))


def test_pack_quantized_subtracts_asymmetric_zero_points():
    generator = torch.Generator().manual_seed(2)
    rows, cols = 11, 64
    values = torch.randint(-8, 8, (rows, cols), generator=generator)
    zero_point = torch.randint(-8, 8, (rows, 2), generator=generator)
    scale = (torch.rand(rows, 2, generator=generator) + 0.1).to(torch.bfloat16)
    expected = pack_quantized_reference(values, scale, 32, zero_point)
    # As compressed-tensors stores them: packed along the output dimension.
    packed_zero_point = pack_int32(zero_point.T, 4).T.contiguous()
    assert packed_zero_point.shape == (2, 2)
    for stored in (packed_zero_point, zero_point.to(torch.int8)):
        out = dequantize_pack_quantized(
            pack_int32(values, 4), scale, [rows, cols], zero_point=stored, dtype=torch.float32
        )
        assert torch.equal(out, expected.float())


def test_packing_follows_compressed_tensors_convention():
    ones = torch.ones(1, 1)
    # pack_to_int32's docstring: 8-bit [1, 2] -> [129, 130] -> 33409.
    out = dequantize_pack_quantized(torch.tensor([[33409]], dtype=torch.int32), ones, [1, 2], 32, 8)
    assert out.tolist() == [[1.0, 2.0]]
    # int4: the first value in the lowest nibble, each offset by 8.
    words = torch.tensor([[0x76543210, 0xFEDCBA98 - (1 << 32)]], dtype=torch.int32)
    out = dequantize_pack_quantized(words, ones, [1, 16], 32, 4, dtype=torch.float32)
    assert out.tolist() == [[float(v) for v in range(-8, 8)]]
    assert torch.equal(pack_int32(torch.arange(-8, 8)[None], 4), words)


def test_int4_round_trip_stays_within_half_a_step():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 96, generator=generator)
    values, scale = quantize_int4_groups(weight)
    assert values.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == (40, 3)
    restored = dequantize_pack_quantized(
        pack_int32(values, 4), scale, [40, 96], dtype=torch.float32
    )
    assert torch.equal(restored, pack_quantized_reference(values, scale, 32).float())
    step = scale.float().repeat_interleave(32, 1)
    # 1e-6: the float32 rounding of the difference itself.
    assert ((restored - weight).abs() <= step / 2 + 1e-6).all()


def test_fp8_checkpoint_dequantizes_weights_and_passes_the_rest_through():
    generator = torch.Generator().manual_seed(4)
    proj, proj_scale = quantize_fp8_blockwise(torch.randn(130, 64, generator=generator))
    norm, router = torch.randn(64, generator=generator), torch.randn(8, 64, generator=generator)
    tensors = {
        "layers.0.self_attn.q_proj.weight": proj,
        "layers.0.self_attn.q_proj.weight_scale_inv": proj_scale,
        "layers.0.input_layernorm.weight": norm,
        "layers.0.mlp.gate.weight": router,
    }
    out = dequantize_checkpoint(tensors, FP8_QUANTIZATION_CONFIG, torch.bfloat16)
    assert set(out) == {
        "layers.0.self_attn.q_proj.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.mlp.gate.weight",
    }
    expected = fp8_reference(proj, proj_scale, (128, 128))
    weight = out["layers.0.self_attn.q_proj.weight"]
    assert weight.dtype == torch.bfloat16
    torch.testing.assert_close(weight.double(), expected, rtol=2**-7, atol=0)
    assert out["layers.0.input_layernorm.weight"] is norm
    assert out["layers.0.mlp.gate.weight"] is router


def test_pack_quantized_checkpoint_dequantizes_experts_and_passes_the_rest_through():
    generator = torch.Generator().manual_seed(5)
    values, scale = quantize_int4_groups(torch.randn(48, 64, generator=generator))
    attention = torch.randn(64, 64, generator=generator)
    expert = "layers.1.mlp.experts.3.down_proj.weight"
    tensors = {
        expert + "_packed": pack_int32(values, 4),
        expert + "_scale": scale,
        expert + "_shape": torch.tensor([48, 64]),
        "layers.1.self_attn.o_proj.weight": attention,
    }
    out = dequantize_checkpoint(tensors, INT4_QUANTIZATION_CONFIG, torch.bfloat16)
    assert set(out) == {expert, "layers.1.self_attn.o_proj.weight"}
    assert torch.equal(out[expert], pack_quantized_reference(values, scale, 32).to(torch.bfloat16))
    assert out["layers.1.self_attn.o_proj.weight"] is attention


def test_no_quantization_config_leaves_the_checkpoint_as_it_is():
    tensors = {"embed_tokens.weight": torch.ones(2, 2)}
    assert dequantize_checkpoint(tensors, None, torch.bfloat16) is tensors


def with_weights(**weights) -> dict:
    config = json.loads(json.dumps(INT4_QUANTIZATION_CONFIG))
    config["config_groups"]["group_0"]["weights"].update(weights)
    return config


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"quant_method": "awq"},
            r"'awq' is not supported; supported: 'fp8' .*'compressed-tensors'",
        ),
        (dict(FP8_QUANTIZATION_CONFIG, weight_block_size=None), "per-tensor fp8"),
        (dict(FP8_QUANTIZATION_CONFIG, fmt="e5m2"), "fp8 format 'e5m2'"),
        (dict(FP8_QUANTIZATION_CONFIG, activation_scheme="static"), "activation_scheme 'static'"),
        (dict(INT4_QUANTIZATION_CONFIG, format="float-quantized"), "format 'float-quantized'"),
        (with_weights(strategy="channel"), "strategy 'channel'"),
        (with_weights(type="float"), "type 'float'"),
        (with_weights(num_bits=2), "2 bits"),
    ],
)
def test_unsupported_quantization_is_refused_by_name(config, message):
    with pytest.raises(ModelLoadError, match=message):
        dequantize_checkpoint({"lm_head.weight": torch.ones(2, 2)}, config, torch.bfloat16)


def test_quantized_weights_missing_their_scales_are_refused():
    fp8 = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    with pytest.raises(ModelLoadError, match=r"o_proj\.weight is torch\.float8_e4m3fn but has no"):
        dequantize_checkpoint({"o_proj.weight": fp8}, FP8_QUANTIZATION_CONFIG, torch.bfloat16)
    packed = {"w.weight_packed": torch.zeros(4, 8, dtype=torch.int32)}
    with pytest.raises(ModelLoadError, match=r"w\.weight_packed has no w\.weight_scale"):
        dequantize_checkpoint(packed, INT4_QUANTIZATION_CONFIG, torch.bfloat16)
    wrong_scale = {
        "w.weight_packed": torch.zeros(4, 8, dtype=torch.int32),
        "w.weight_scale": torch.ones(4, 1),
        "w.weight_shape": torch.tensor([4, 64]),
    }
    with pytest.raises(ModelLoadError, match=r"w.weight_packed: .*needs scales of shape \(4, 2\)"):
        dequantize_checkpoint(wrong_scale, INT4_QUANTIZATION_CONFIG, torch.bfloat16)


@pytest.fixture(scope="module")
def tiny_deepseek_dir(tmp_path_factory):
    """DeepSeek-V3 (Kimi K2's architecture): a dense first layer 160 wide, so its projections
    span a 128-block and an edge block, then 8 routed experts 48 wide, whose down projections
    end in a half group of 16."""
    directory = tmp_path_factory.mktemp("tiny-deepseek-v3")
    tokenizer = build_tokenizer(directory)
    config = DeepseekV3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=48,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(directory))
    return directory


def read_tensors(directory) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def load_plain_copy(directory):
    """The float32 directory through transformers, which must find every weight it expects."""
    model, info = AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 5, 9, 2]])).logits).all()
    return model


def test_fp8_checkpoint_of_a_tiny_deepseek(tiny_deepseek_dir, tmp_path):
    original = read_tensors(tiny_deepseek_dir)
    fp8_dir = write_fp8_checkpoint(tiny_deepseek_dir, tmp_path / "fp8")
    stored = read_tensors(fp8_dir)
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    layer0, layer1 = "model.layers.0.", "model.layers.1."
    grids = {
        layer0 + "mlp.gate_proj.weight": (2, 1),  # 160 x 64
        layer0 + "mlp.down_proj.weight": (1, 2),  # 64 x 160
        layer0 + "self_attn.kv_a_proj_with_mqa.weight": (1, 1),
        layer0 + "self_attn.kv_b_proj.weight": (1, 1),  # 128 x 32
        layer1 + "mlp.experts.7.down_proj.weight": (1, 1),
        layer1 + "mlp.shared_experts.up_proj.weight": (1, 1),
    }
    for name, grid in grids.items():
        assert stored[name].dtype == torch.float8_e4m3fn
        assert stored[name + "_scale_inv"].shape == grid
    for name in ("model.embed_tokens.weight", "lm_head.weight", layer1 + "mlp.gate.weight"):
        assert torch.equal(stored[name], original[name])
    assert {n for n, t in original.items() if is_fp8_projection(n, t)} == {
        n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn
    }

    plain_dir = dequantized_copy(fp8_dir, tmp_path / "plain")
    load_plain_copy(plain_dir)
    plain = read_tensors(plain_dir)
    assert set(plain) == set(original)
    for name, tensor in original.items():
        if is_fp8_projection(name, tensor):
            expected = fp8_reference(stored[name], stored[name + "_scale_inv"], (128, 128))
            assert torch.equal(plain[name], expected.float())
        else:
            assert torch.equal(plain[name], tensor)


def test_int4_experts_checkpoint_of_a_tiny_deepseek(tiny_deepseek_dir, tmp_path):
    original = read_tensors(tiny_deepseek_dir)
    int4_dir = write_int4_experts_checkpoint(tiny_deepseek_dir, tmp_path / "int4")
    stored = read_tensors(int4_dir)
    config = json.loads((int4_dir / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    assert config["format"] == "pack-quantized"
    assert config["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert "re:.*self_attn.*" in config["ignore"]

    experts = [name for name in original if is_routed_expert(name)]
    assert len(experts) == 8 * 3
    down = "model.layers.1.mlp.experts.5.down_proj.weight"  # 64 x 48: words of 8, groups of 32
    assert stored[down + "_packed"].shape == (64, 6)
    assert (
        stored[down + "_scale"].shape == (64, 2) and stored[down + "_scale"].dtype == torch.bfloat16
    )
    assert stored[down + "_shape"].tolist() == [64, 48]
    for name, tensor in original.items():
        if name in experts:
            assert name not in stored
        else:
            assert torch.equal(stored[name], tensor)

    plain_dir = dequantized_copy(int4_dir, tmp_path / "plain")
    load_plain_copy(plain_dir)
    plain = read_tensors(plain_dir)
    assert set(plain) == set(original)
    for name, tensor in original.items():
        if name in experts:
            values, scale = quantize_int4_groups(tensor)
            expected = pack_quantized_reference(values, scale, 32).float()
            assert torch.equal(plain[name], expected)
        else:
            assert torch.equal(plain[name], tensor)
