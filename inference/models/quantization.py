"""Turn the weights of a quantized checkpoint into plain tensors, once, at load time.

Two formats, the ones the DeepSeek-V3 family ships:

- `fp8`, block-wise e4m3 (DeepSeek-V3, Kimi K2): `X.weight` is float8_e4m3fn [N, K] and
  `X.weight_scale_inv` is float32 [ceil(N / 128), ceil(K / 128)], one multiplier per 128 x 128
  block, edge blocks included.
- `compressed-tensors` "pack-quantized" (Kimi K2 Thinking's and K2.5's routed experts): int4
  values in groups of 32 along the input dimension, packed eight to an int32; see
  `dequantize_pack_quantized`. Their config has one config group (weights: type int, 4 bits,
  symmetric, strategy group, group_size 32) and an `ignore` list (K2.5/K2.6, as vLLM's tests
  quote it: `re:.*self_attn.*`, `re:.*shared_experts.*`, `re:.*mlp\\.(gate|up|gate_up|down)_proj.*`,
  `re:.*lm_head.*`, `re:vision_tower.*`, `re:mm_projector.*`), so only routed experts are packed.

The engine then runs on the dequantized weights: this saves no memory, it only makes these
checkpoints loadable.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import torch

from inference.errors import ModelLoadError

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_fp8_blockwise(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """W[n, k] = float(weight[n, k]) * scale_inv[n // bn, k // bk], computed in float32.

    `weight` is float8_e4m3fn [N, K]; `scale_inv` is float32 [ceil(N / bn), ceil(K / bk)], so
    N and K need not be multiples of the block. This is DeepSeek-V3's `weight_dequant`.
    """
    if weight.dim() != 2:
        raise ModelLoadError(f"an fp8 weight must be 2-D, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    block_rows, block_cols = block_size
    expected = (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
    if tuple(scale_inv.shape) != expected:
        raise ModelLoadError(
            f"an fp8 weight of shape {(rows, cols)} in {block_rows}x{block_cols} blocks needs "
            f"scales of shape {expected}, got {tuple(scale_inv.shape)}"
        )
    scale = scale_inv.float().repeat_interleave(block_rows, 0)[:rows]
    scale = scale.repeat_interleave(block_cols, 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def dequantize_pack_quantized(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor | Sequence[int],
    group_size: int = 32,
    num_bits: int = 4,
    zero_point: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Dequantize a compressed-tensors "pack-quantized" weight: W[n, k] = (q[n, k] - z) * s.

    Packing, as compressed-tensors' `pack_to_int32` / `unpack_from_int32` write and read it
    (src/compressed_tensors/compressors/quantized_compressors/pack_quantized.py in
    vllm-project/compressed-tensors, formerly neuralmagic/compressed-tensors):

    - q is a signed integer in [-2^(b-1), 2^(b-1) - 1] (b = `num_bits`); it is stored offset to
      unsigned, u = q + 2^(b-1) (for int4: q = -8..7 is stored as u = 0..15).
    - Each row of `weight_packed` (int32 [N, ceil(K / (32 // b))]) holds 32 // b consecutive
      input-dimension values per word, the first in the lowest bits: value k of a row is bits
      [b * (k % p), b * (k % p) + b) of word k // p, p = 32 // b. The last word of a row is
      zero-padded; `weight_shape` ([N, K]) says where the row ends.
    - `weight_scale` [N, ceil(K / group_size)] holds one scale per group of `group_size`
      consecutive input-dimension values (Kimi K2.5: int4, groups of 32, bf16 scales, symmetric).
    - Symmetric quantization stores no zero point (z = 0). Asymmetric stores `weight_zero_point`
      [N, groups], signed in the same range as q, packed the same way but along the output
      dimension (int32 [ceil(N / p), groups]); pass it as stored, or already unpacked as an
      integer tensor of another dtype.

    Computed in float32, then cast to `dtype`.
    """
    rows, cols = (int(v) for v in weight_shape)
    values_per_word = _values_per_word(num_bits)
    expected_packed = (rows, math.ceil(cols / values_per_word))
    if weight_packed.dtype != torch.int32 or tuple(weight_packed.shape) != expected_packed:
        raise ModelLoadError(
            f"a {num_bits}-bit packed weight of shape {(rows, cols)} needs int32 words of shape "
            f"{expected_packed}, got {weight_packed.dtype} {tuple(weight_packed.shape)}"
        )
    groups = math.ceil(cols / group_size)
    if tuple(weight_scale.shape) != (rows, groups):
        raise ModelLoadError(
            f"a weight of shape {(rows, cols)} in groups of {group_size} needs scales of shape "
            f"{(rows, groups)}, got {tuple(weight_scale.shape)}"
        )
    values = _unpack_rows(weight_packed, num_bits, cols)
    if zero_point is not None:
        if zero_point.dtype == torch.int32:
            zero_point = _unpack_rows(zero_point.T.contiguous(), num_bits, rows).T
        if tuple(zero_point.shape) != (rows, groups):
            raise ModelLoadError(
                f"a weight of shape {(rows, cols)} in groups of {group_size} needs zero points "
                f"of shape {(rows, groups)}, got {tuple(zero_point.shape)}"
            )
        values = values - zero_point.to(torch.int32).repeat_interleave(group_size, 1)[:, :cols]
    scale = weight_scale.float().repeat_interleave(group_size, 1)[:, :cols]
    return (values.float() * scale).to(dtype)


def dequantize_checkpoint(
    tensors: dict[str, torch.Tensor], quantization_config: dict | None, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every quantized weight replaced by its `X.weight` in `dtype`.

    The scale, packed and shape tensors are dropped; every other tensor passes through unchanged
    (for Kimi K2.5 the attention, the shared experts, the dense MLPs and lm_head, which its
    config's `ignore` list names). Which weights are quantized is read from the tensors
    themselves: an `X.weight_scale_inv` (fp8) or an `X.weight_packed` (pack-quantized).
    `quantization_config` is the checkpoint's `quantization_config`; None returns `tensors`.
    """
    if quantization_config is None:
        return tensors
    method = quantization_config.get("quant_method")
    if method == "fp8":
        return _dequantize_fp8_checkpoint(tensors, quantization_config, dtype)
    if method == "compressed-tensors":
        return _dequantize_compressed_tensors(tensors, quantization_config, dtype)
    raise ModelLoadError(
        f"quantization method {method!r} is not supported; supported: 'fp8' (block-wise e4m3, as "
        "DeepSeek-V3 and Kimi K2 ship) and 'compressed-tensors' in format 'pack-quantized' (as "
        "Kimi K2.5 ships)"
    )


def _dequantize_fp8_checkpoint(
    tensors: dict[str, torch.Tensor], config: dict, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    # HF's own fp8 configs (FineGrainedFP8Config) omit "fmt"; they are e4m3 too.
    fmt = config.get("fmt", "e4m3")
    block_size = config.get("weight_block_size")
    if fmt != "e4m3":
        raise ModelLoadError(f"fp8 format {fmt!r} is not supported; supported: 'e4m3'")
    if block_size is None or len(block_size) != 2:
        raise ModelLoadError(
            "per-tensor fp8 (no weight_block_size) is not supported; supported: block-wise fp8 "
            "with weight_block_size [rows, cols], as DeepSeek-V3 ships"
        )
    if config.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelLoadError(
            f"fp8 activation_scheme {config['activation_scheme']!r} is not supported; "
            "supported: 'dynamic'"
        )
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight_scale_inv"):
            if name.removesuffix("_scale_inv") not in tensors:
                raise ModelLoadError(f"{name} has no weight beside it")
            continue
        scale_inv = tensors.get(name + "_scale_inv")
        if scale_inv is not None:
            if tensor.dtype != torch.float8_e4m3fn:
                raise ModelLoadError(f"{name} has a weight_scale_inv but is {tensor.dtype}")
            out[name] = _named(
                name, dequantize_fp8_blockwise, tensor, scale_inv, tuple(block_size), dtype
            )
        elif tensor.dtype in _FP8_DTYPES:
            raise ModelLoadError(f"{name} is {tensor.dtype} but has no {name}_scale_inv")
        else:
            out[name] = tensor
    return out


def _dequantize_compressed_tensors(
    tensors: dict[str, torch.Tensor], config: dict, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    if config.get("format") != "pack-quantized":
        raise ModelLoadError(
            f"compressed-tensors format {config.get('format')!r} is not supported; "
            "supported: 'pack-quantized'"
        )
    weights = _pack_quantized_scheme(config)
    group_size, num_bits = weights["group_size"], weights["num_bits"]
    symmetric = weights.get("symmetric", True)
    if any(name.endswith(".weight_g_idx") for name in tensors):
        raise ModelLoadError(
            "compressed-tensors weights with activation ordering (weight_g_idx) are not supported"
        )
    consumed: set[str] = set()
    out: dict[str, torch.Tensor] = {}
    for name in tensors:
        if not name.endswith(".weight_packed"):
            continue
        weight = name.removesuffix("_packed")
        scale, shape, zero_point = (f"{weight}_{part}" for part in ("scale", "shape", "zero_point"))
        required = [scale, shape] if symmetric else [scale, shape, zero_point]
        missing = [part for part in required if part not in tensors]
        if missing:
            raise ModelLoadError(f"{name} has no {missing[0]} beside it")
        out[weight] = _named(
            name,
            dequantize_pack_quantized,
            tensors[name],
            tensors[scale],
            tensors[shape].tolist(),
            group_size,
            num_bits,
            None if symmetric else tensors[zero_point],
            dtype,
        )
        consumed.update([name, *required])
    for name, tensor in tensors.items():
        if name not in consumed:
            out[name] = tensor
    return out


def _pack_quantized_scheme(config: dict) -> dict:
    """The one weight scheme of a pack-quantized config, checked to be one this module reads."""
    groups = config.get("config_groups") or {}
    schemes = {json.dumps(group.get("weights"), sort_keys=True) for group in groups.values()}
    if len(schemes) != 1:
        raise ModelLoadError(
            f"a pack-quantized config needs exactly one weight scheme across its config_groups, "
            f"got {len(schemes)}"
        )
    if any(group.get("input_activations") for group in groups.values()):
        raise ModelLoadError("pack-quantized configs with quantized activations are not supported")
    weights = json.loads(schemes.pop())
    if weights is None:
        raise ModelLoadError("the pack-quantized config group quantizes no weights")
    kind, strategy, num_bits = weights.get("type"), weights.get("strategy"), weights.get("num_bits")
    if kind != "int" or strategy != "group" or num_bits not in (4, 8):
        raise ModelLoadError(
            f"pack-quantized weights of type {kind!r}, strategy {strategy!r}, {num_bits} bits "
            "are not supported; supported: type 'int', strategy 'group', 4 or 8 bits"
        )
    if not weights.get("group_size"):
        raise ModelLoadError("the pack-quantized group strategy needs a group_size")
    return weights


def _named(name: str, dequantize, *args) -> torch.Tensor:
    """Call `dequantize`, naming the tensor in any error it raises."""
    try:
        return dequantize(*args)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{name}: {exc}") from None


def _values_per_word(num_bits: int) -> int:
    if not 1 <= num_bits <= 8:
        raise ModelLoadError(f"packing {num_bits}-bit values is not supported; supported: 1 to 8")
    return 32 // num_bits


def _unpack_rows(packed: torch.Tensor, num_bits: int, length: int) -> torch.Tensor:
    """int32 words [R, W] -> the signed values [R, length] they pack, lowest bits first."""
    shifts = torch.arange(_values_per_word(num_bits), dtype=torch.int32) * num_bits
    # `>>` is arithmetic on int32; the mask drops the copied sign bits.
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
    return fields.flatten(1)[:, :length] - (1 << (num_bits - 1))
