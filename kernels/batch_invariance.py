"""Batch-invariant mode: each row's result does not depend on what else is in the step.

A matmul, a norm or an attention may add up a row's terms in an order that depends on how many
rows share the call (a BLAS picks its kernel by shape), and in bfloat16 a different order can
change a token. Under `batch_invariant()` the ops that could (`attention`, and `linear` for
weights torch's BLAS would run) take the paths whose order is fixed per row:

- `linear`: bf16 and float32 weights are packed for oneDNN, whose kernels reduce each row in one
  fixed order for any number of rows (a lone row goes as two); int4 weights run their
  dequantized copy for every batch size (the one-row int4 kernel sums differently).
- `attention`: `kernels.invariant_attention`, keys in fixed splits of `KEY_SPLIT` positions.
- sigmoid and SiLU: computed from `exp` (`sigmoid`, `silu` below).
- RMSNorm, rotary and log-softmax are row-wise already (`probe_row_invariance` checks it on the
  machine at hand).

It holds for a dtype whose matmuls keep a row's bits (`matmul_rows_keep_their_bits`): bfloat16
on a CPU with native bf16 (oneDNN), and float32, whose linears are packed for oneDNN (as in every
mode) and whose other matmuls (the attention's, the experts', a plain weight's) run
`kernels.fixed_order_matmul` in this mode (torch's BLAS picks its float32 kernel by shape, batch
count and threads). Where the fixed-order kernels can't be built (no
compiler), float32 fails the check and the engine refuses the mode rather than promise what it
can't keep.

The mode is a context variable, so the engine sets it around its own forward and a process can
hold engines in both modes. `probe_row_invariance` is the record of which of torch's paths keep
a row's bits on this CPU when the number of rows changes (docs/determinism.md lists a run).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from kernels import fixed_order_matmul

_BATCH_INVARIANT = contextvars.ContextVar("hearth_batch_invariant", default=False)

# Row counts the probe compares: 1 and 2 (BLAS takes a matrix-vector path for one row), tile
# edges, and a prefill's worth.
_PROBE_ROWS = (1, 2, 3, 7, 16, 17, 33, 64, 129, 256, 257, 1024)


@contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Run the ops inside in batch-invariant mode (or, with `enabled=False`, in default mode)."""
    token = _BATCH_INVARIANT.set(enabled)
    try:
        yield
    finally:
        _BATCH_INVARIANT.reset(token)


def is_batch_invariant() -> bool:
    """Whether the current context runs the batch-invariant paths."""
    return _BATCH_INVARIANT.get()


def one_row_as_two(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)`, except that in batch-invariant mode a single row goes through `fn` as two:
    oneDNN runs one row through another kernel than two or more, and on real weights it rounds
    an element differently now and then (SmolLM2's down_proj of layer 18: one of 576 outputs,
    by 2e-6), so a row's result would depend on whether it was alone in its call."""
    if x.shape[0] == 1 and is_batch_invariant():
        return fn(x.expand(2, -1))[:1]
    return fn(x)


# torch's sigmoid and SiLU kernels run most elements through vector code (Sleef) and a few
# through scalar code, which rounds differently now and then: the last few of each run, and a
# thread's run starts wherever the split falls. Which elements those are depends on the tensor's
# size, so a row's bits would depend on the step (measured: a shared-expert gate [T, 1], an
# expert's SiLU over more tokens than one thread takes). torch's exp runs every element through
# the vector code, tail included, and +, / and reciprocal round exactly: so these two.


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid; in batch-invariant mode 1 / (1 + exp(-x)) in float32, which gives an
    element the same bits wherever it lies in the tensor."""
    if not is_batch_invariant():
        return torch.sigmoid(x)
    return torch.reciprocal(torch.exp(-x.float()).add_(1)).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """F.silu; in batch-invariant mode x / (1 + exp(-x)) in float32 (see `sigmoid`)."""
    if not is_batch_invariant():
        return F.silu(x)
    x32 = x.float()
    return (x32 / torch.exp(-x32).add_(1)).to(x.dtype)


def batched_matmul(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """[..., M, K] @ [..., K, N] as one batched matmul over the flattened leading dimensions,
    the left operand contiguous: `torch.matmul` takes another path for a leading dimension of
    1, and a BLAS may pick another kernel for another layout. The caller gives `right` in one
    layout every time (the attention: keys transposed, values as they are, both from
    contiguous [..., keys, D]). float32 runs the fixed-order kernels
    (`kernels.fixed_order_matmul`), other dtypes `torch.bmm`."""
    batch = left.shape[:-2]
    left = left.reshape(-1, *left.shape[-2:]).contiguous()
    right = right.reshape(-1, *right.shape[-2:])
    if left.dtype != torch.float32:
        out = torch.bmm(left, right)
    elif right.transpose(1, 2).is_contiguous():
        out = fixed_order_matmul.dot_nt(left, right.transpose(1, 2))
    else:
        out = fixed_order_matmul.dot_nn(left, right)
    return out.view(*batch, *out.shape[-2:])


def matmul_nt(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T with torch's matmul; in batch-invariant mode a row's bits do not
    depend on T (float32: the fixed-order kernel; other dtypes: oneDNN, a lone row as two)."""
    if is_batch_invariant() and x.dtype == torch.float32:
        return fixed_order_matmul.dot_nt(x.unsqueeze(0), weight.unsqueeze(0))[0]
    return one_row_as_two(functools.partial(torch.mm, mat2=weight.t()), x)


@functools.cache
def matmul_rows_keep_their_bits(dtype: torch.dtype) -> bool:
    """Whether the attention's batched matmul (`batched_matmul`) gives a row the same bits
    whatever the number of rows and items in its call, on this CPU, at 1 and 2 threads
    (bfloat16 through oneDNN: yes on a CPU with native bf16; float32 through the fixed-order
    kernels: yes, where they could be built)."""
    if dtype == torch.float32 and fixed_order_matmul.available() is not None:
        return False
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 3, 256, 64, generator=generator).to(dtype).transpose(-1, -2)
    rows = torch.randn(3, 3, 700, 64, generator=generator).to(dtype)
    threads = torch.get_num_threads()
    try:
        for count in sorted({1, min(2, threads), threads}):
            torch.set_num_threads(count)
            alone = batched_matmul(rows[:1, :, :3], keys[:1])
            for items in (1, 3):
                for length in (4, 16, 100, 700):
                    together = batched_matmul(rows[:items, :, :length], keys[:items])
                    if not torch.equal(together[:1, :, :3], alone):
                        return False
    finally:
        torch.set_num_threads(threads)
    return True


def rows_keep_their_bits(fn: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor) -> bool:
    """Whether `fn` gives each of the first rows of `inputs` the same bits for every row count in
    `_PROBE_ROWS` (and at 1 and 2 threads) as when that row is computed alone."""
    threads = torch.get_num_threads()
    alone = torch.cat([fn(inputs[i : i + 1]) for i in range(4)])
    try:
        for count in sorted({1, min(2, threads), threads}):
            torch.set_num_threads(count)
            for rows in _PROBE_ROWS:
                seen = min(rows, 4)
                if not torch.equal(fn(inputs[:rows])[:seen], alone[:seen]):
                    return False
    finally:
        torch.set_num_threads(threads)
    return True


def probe_row_invariance(dtype: torch.dtype, hidden: int = 576, out: int = 1536) -> dict:
    """For each candidate path, whether it keeps a row's bits as the row count changes, on this
    CPU and torch build: `{name: bool}`. Random inputs each call."""
    from kernels.linear import pack_linear_weight_for_onednn

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out, hidden, generator=generator).to(dtype) / hidden**0.5
    inputs = torch.randn(1024, hidden, generator=generator).to(dtype)
    packed = pack_linear_weight_for_onednn(weight)
    eps = 1e-5

    def rms(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    return {
        "linear (torch's BLAS, plain weight)": rows_keep_their_bits(
            lambda x: F.linear(x, weight), inputs
        ),
        "linear (oneDNN, packed weight)": packed is not None
        and rows_keep_their_bits(
            lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), inputs
        ),
        "rms_norm": rows_keep_their_bits(rms, inputs),
        "log_softmax": rows_keep_their_bits(lambda x: torch.log_softmax(x.float(), -1), inputs),
        "silu_and_mul": rows_keep_their_bits(
            lambda x: F.silu(x[:, : hidden // 2]) * x[:, hidden // 2 :], inputs
        ),
    }
