"""Write quantized copies of a tiny Hugging Face model directory, as DeepSeek-V3 / Kimi K2 (fp8)
and Kimi K2.5 (int4 routed experts) ship theirs, and plain float32 copies of what they decode to.

The quantizers and the int32 packer here are written independently of
`inference.models.quantization`, from the formats' definitions, so that tests can check one
against the other.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inference.models.quantization import dequantize_checkpoint

FP8_E4M3_MAX = 448.0
FP8_BLOCK = (128, 128)
INT4_GROUP_SIZE = 32

FP8_QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(FP8_BLOCK),
}

# Kimi K2.5's config, with `shared_expert` (Qwen2-MoE's spelling) and routers (`mlp.gate`) added
# to its ignore list so that it also describes the other families' checkpoints.
INT4_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": INT4_GROUP_SIZE,
                "dynamic": False,
                "actorder": None,
                "block_structure": None,
                "observer": "minmax",
                "observer_kwargs": {},
            },
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_expert.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
        r"re:.*mlp\.gate$",
    ],
}

_ROUTED_EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")


def quantize_fp8_blockwise(
    weight: torch.Tensor, block_size: tuple[int, int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 weight_scale_inv) with scale = block amax / 448, as
    DeepSeek-V3 computes it; edge blocks are whatever part of a block the weight covers."""
    rows, cols = weight.shape
    block_rows, block_cols = block_size
    grid = (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
    padded = torch.zeros(grid[0] * block_rows, grid[1] * block_cols)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid[0], block_rows, grid[1], block_cols)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, 1.0)
    scaled = (blocks / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    quantized = scaled.view(padded.shape)[:rows, :cols].to(torch.float8_e4m3fn)
    return quantized.contiguous(), scale


def quantize_int4_groups(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values in [-8, 7], bf16 scales [rows, ceil(cols / group_size)]), symmetric, with
    scale = group amax / 7 rounded to bf16 first so that the values fit the stored scale. A last
    group narrower than `group_size` is quantized like the others."""
    rows, cols = weight.shape
    groups = math.ceil(cols / group_size)
    padded = torch.zeros(rows, groups * group_size)
    padded[:, :cols] = weight.float()
    grouped = padded.view(rows, groups, group_size)
    scale = (grouped.abs().amax(dim=-1) / 7).to(torch.bfloat16)
    divisor = torch.where(scale > 0, scale.float(), 1.0)
    values = torch.round(grouped / divisor[..., None]).clamp(-8, 7).to(torch.int8)
    return values.view(rows, -1)[:, :cols].contiguous(), scale


def pack_int32(values: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Pack signed `num_bits` values [R, C] into int32 words [R, ceil(C / (32 // num_bits))]:
    stored offset by 2^(num_bits - 1), value k in bits num_bits * (k % p) upwards of word k // p
    (compressed-tensors' pack_to_int32)."""
    per_word = 32 // num_bits
    unsigned = (values.to(torch.int64) + (1 << (num_bits - 1))).numpy().astype(np.uint32)
    rows, cols = unsigned.shape
    words = np.zeros((rows, math.ceil(cols / per_word)), dtype=np.uint32)
    for k in range(cols):
        words[:, k // per_word] |= unsigned[:, k] << np.uint32(num_bits * (k % per_word))
    return torch.from_numpy(words.view(np.int32).copy())


def is_fp8_projection(name: str, tensor: torch.Tensor) -> bool:
    """A 2-D projection weight (`*proj*`, Mixtral's `w1/w2/w3`, experts'), which DeepSeek-V3
    stores in fp8; embeddings, norms, lm_head and routers stay in their float type."""
    if tensor.dim() != 2 or not name.endswith(".weight"):
        return False
    module = name.split(".")[-2]
    return "proj" in module or module in ("w1", "w2", "w3")


def is_routed_expert(name: str) -> bool:
    """`...mlp.experts.N.{gate,up,down}_proj.weight`: what Kimi K2.5 stores in int4."""
    return _ROUTED_EXPERT.fullmatch(name) is not None


def write_fp8_checkpoint(src: Path, dst: Path) -> Path:
    """Copy the float32 model directory `src` to `dst` with every projection weight in block-wise
    fp8 (`X.weight` float8_e4m3fn, `X.weight_scale_inv` float32, 128 x 128 blocks) and
    DeepSeek-V3's quantization_config in config.json."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in _read_tensors(src).items():
        if is_fp8_projection(name, tensor):
            out[name], out[name + "_scale_inv"] = quantize_fp8_blockwise(tensor)
        else:
            out[name] = tensor
    return _write_directory(src, dst, out, FP8_QUANTIZATION_CONFIG)


def write_int4_experts_checkpoint(src: Path, dst: Path) -> Path:
    """Copy the float32 model directory `src` to `dst` with the routed experts' weights in
    compressed-tensors pack-quantized int4 (groups of 32, bf16 scales, symmetric), everything
    else as it was, and a quantization_config shaped like Kimi K2.5's."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in _read_tensors(src).items():
        if is_routed_expert(name):
            values, scale = quantize_int4_groups(tensor)
            out[name + "_packed"] = pack_int32(values, 4)
            out[name + "_scale"] = scale
            out[name + "_shape"] = torch.tensor(tensor.shape, dtype=torch.int64)
        else:
            out[name] = tensor
    return _write_directory(src, dst, out, INT4_QUANTIZATION_CONFIG)


def dequantized_copy(dst: Path, out: Path) -> Path:
    """Write the quantized directory `dst` as a plain float32 model directory `out`: the weights
    the engine sees after dequantizing, for transformers to run."""
    config = json.loads((dst / "config.json").read_text())
    quantization_config = config.pop("quantization_config")
    tensors = dequantize_checkpoint(_read_tensors(dst), quantization_config, torch.float32)
    return _write_directory(dst, out, {n: t.float() for n, t in tensors.items()}, None)


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                tensors[name] = f.get_tensor(name)
    return tensors


def _write_directory(
    src: Path, dst: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None
) -> Path:
    """`src`'s tokenizer and config files, with `quantization_config` set in config.json (or
    none), and `tensors` as one safetensors file."""
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.is_file() and not file.name.startswith("model.safetensors"):
            shutil.copy2(file, dst / file.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
