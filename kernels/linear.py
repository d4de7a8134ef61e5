"""Dense projection y = x W^T + b, the weight layouts it runs fastest from, and int4 weights.

On the CPU, a bfloat16 or float32 weight is reordered once into oneDNN's blocked layout
(`pack_linear_weight`): an unpacked bf16 weight is re-laid-out on every call, and oneDNN's packed
float32 kernels beat torch's BLAS on the engine's shapes (docs/performance.md, issue 28) and keep
a row's bits in any batch, which the BLAS does not (kernels.batch_invariance).

Decoding one sequence reads every weight once per token, so its speed is the memory bandwidth
divided by the weight bytes. `Int4Weight` holds a weight quantized to 4 bits in groups of 32 along
the input dimension (asymmetric: w = (q - 8) * scale + zero, as torch's int4 CPU kernel
defines it), a quarter of the bf16 bytes; one-row inputs run the int4 kernel, larger batches (which
are compute-bound, where the int4 kernel is slow) run a bf16 copy of the same dequantized values
(every batch size does in batch-invariant mode).
For weights that were 4-bit already (a Q4_0/Q4_1 GGUF), min/max grouping recovers their grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.batch_invariance import is_batch_invariant, matmul_nt, one_row_as_two

# Batch size oneDNN tunes the packed layout for; any batch size runs with it.
_PACK_BATCH_HINT = 32
INT4_GROUP_SIZE = 32


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """The layout `linear` should be given `weight` in: packed for oneDNN on a CPU that has it
    (bf16 and float32), else as it is."""
    packed = pack_linear_weight_for_onednn(weight)
    return weight if packed is None else packed


def pack_linear_weight_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` reordered into oneDNN's blocked layout, or None where oneDNN can't run it."""
    if weight.is_cuda or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    if weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_BATCH_HINT)


def int4_group_quantize(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [N, K] (int32 in 0..15), scales and zeros [N, K / group_size] (float32)."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"int4 needs in_features divisible by {group_size}, got {in_features}")
    groups = weight.float().view(out_features, in_features // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = (high - low).clamp(min=1e-8) / 15
    codes = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15)
    zeros = low + 8 * scales
    return codes.to(torch.int32).view(out_features, in_features), scales, zeros


def int4_dequantize(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The float32 weight that int4 codes stand for: (q - 8) * scale + zero per group."""
    out_features, in_features = codes.shape
    groups = codes.view(out_features, in_features // group_size, group_size).float() - 8
    return (groups * scales[..., None].float() + zeros[..., None].float()).view(codes.shape)


@dataclass
class Int4Weight:
    """A projection weight in int4 (for one-row inputs) and dequantized bf16 (for batches)."""

    packed: torch.Tensor  # torch's CPU int4 layout
    scales_and_zeros: torch.Tensor  # [K / group_size, N, 2], bfloat16
    group_size: int
    dense: torch.Tensor  # dequantized, bf16, in `pack_linear_weight`'s layout

    @classmethod
    def quantize(cls, weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> Int4Weight:
        if weight.is_mkldnn:
            weight = weight.to_dense()
        codes, scales, zeros = int4_group_quantize(weight, group_size)
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1)
        scales_and_zeros = scales_and_zeros.contiguous().to(torch.bfloat16)
        # The batch path uses exactly the (bf16-rounded) scales and zeros the int4 kernel uses.
        dense = int4_dequantize(
            codes, scales_and_zeros[..., 0].T, scales_and_zeros[..., 1].T, group_size
        )
        return cls(
            packed=torch._convert_weight_to_int4pack_for_cpu(codes, 1),
            scales_and_zeros=scales_and_zeros,
            group_size=group_size,
            dense=pack_linear_weight(dense.to(torch.bfloat16)),
        )


def linear_torch(
    x: torch.Tensor, weight: torch.Tensor | Int4Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] @ weight[N, K]^T (+ bias[N]) -> [T, N]; `weight` plain, packed or int4."""
    if isinstance(weight, Int4Weight):
        # The int4 kernel sums a row differently from the dense copy: batch-invariant mode
        # runs the dense copy for every batch size.
        if x.shape[0] == 1 and not is_batch_invariant():
            out = torch._weight_int4pack_mm_for_cpu(
                x, weight.packed, weight.group_size, weight.scales_and_zeros
            )
            return out if bias is None else out + bias
        weight = weight.dense
    if weight.is_mkldnn:
        return one_row_as_two(
            lambda rows: torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], ""), x
        )
    if is_batch_invariant() and weight.dtype == torch.float32:
        # A plain float32 weight (a MoE router or shared-expert gate, which stay unpacked, or a
        # CPU without oneDNN): the fixed-order kernel, slower than oneDNN, row-invariant.
        out = matmul_nt(x, weight)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)
