"""Kernel benchmark: each Triton kernel against the device's own ceilings and its PyTorch
reference (and `scaled_dot_product_attention` for attention), measured in the same run.

On a CUDA device it first measures the ceilings:
- `copy_gb_s`: a 2 GiB device-to-device copy, counting bytes read and written;
- `matmul_tflop_s`: an 8192³ bf16 matmul.

Then, for each kernel at realistic sizes, its time, the achieved GB/s (memory-bound kernels:
norms, rotary, activations, the KV store, decode attention, MLA decode) or TFLOP/s (extend
attention, fused MoE), the fraction of the matching ceiling, and its speed relative to the
PyTorch reference (and to SDPA over an already-gathered contiguous K/V, for attention). Targets
(issue 4, H200): memory-bound kernels ≥ 70 % of the copy bandwidth, extend attention ≥ 40 % and
fused MoE ≥ 35 % of the matmul rate, every kernel faster than its reference. The last line of
stdout is one JSON object, also written to bench/results/kernels.json.

    .venv/bin/python bench/kernels.py            # on a CUDA machine
    .venv/bin/python bench/kernels.py --smoke    # tiny sizes on the CPU under Triton's
                                                 # interpreter: checks the script, not speed

Decode attention uses batch 64, 32 query heads, 8 KV heads, head dim 128, blocks of 16 and
contexts of 1k to 32k; MLA decode (DeepSeek-V3's absorbed form) batch 64, 16 heads (one rank
of eight), a 512 + 64 latent row per token, the same contexts; extend attention 8 sequences of
2k new tokens over 4k cached; fused MoE 64 experts, top-8, 4k tokens (hidden 2048, expert width
1408, DeepSeek-V2-Lite's shapes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

SMOKE = "--smoke" in sys.argv
if SMOKE:
    # Before any kernel module is imported: Triton reads it when the kernels are defined.
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from kernels.activation import (  # noqa: E402
    gelu_and_mul_torch,
    gelu_and_mul_triton,
    silu_and_mul_torch,
    silu_and_mul_triton,
)
from kernels.attention import (  # noqa: E402
    build_paged_attention_batch,
    store_kvcache_torch,
    store_kvcache_triton,
)
from kernels.decode_attention import decode_attention_torch, decode_attention_triton  # noqa: E402
from kernels.extend_attention import extend_attention_torch, extend_attention_triton  # noqa: E402
from kernels.fused_moe import fused_moe_torch, fused_moe_triton  # noqa: E402
from kernels.mla_attention import mla_decode_torch, mla_decode_triton  # noqa: E402
from kernels.moe_router import select_experts_torch as select_experts  # noqa: E402
from kernels.rms_norm import rms_norm_torch, rms_norm_triton  # noqa: E402
from kernels.rotary import rotary_torch, rotary_triton  # noqa: E402

RESULTS = REPO_ROOT / "bench" / "results"
GB = 1e9
TFLOP = 1e12


@dataclass
class Row:
    """One kernel's measurement."""

    kernel: str
    shape: str
    ms: float
    rate: float  # GB/s or TFLOP/s, per `unit`
    unit: str
    ceiling_fraction: float
    target_fraction: float
    reference_ms: float | None
    sdpa_ms: float | None

    @property
    def vs_reference(self) -> float | None:
        return self.reference_ms / self.ms if self.reference_ms else None

    @property
    def vs_sdpa(self) -> float | None:
        return self.sdpa_ms / self.ms if self.sdpa_ms else None

    @property
    def met(self) -> bool:
        faster = self.vs_reference is None or self.vs_reference > 1.0
        return self.ceiling_fraction >= self.target_fraction and faster


class Bench:
    """Times functions on the chosen device; sizes shrink with `--smoke`."""

    def __init__(self, device: str, smoke: bool) -> None:
        self.device = device
        self.smoke = smoke
        self.rows: list[Row] = []
        self.copy_gb_s = 0.0
        self.matmul_tflop_s = 0.0

    def time_ms(self, fn: Callable[[], object]) -> float:
        if self.device == "cuda":
            return float(triton.testing.do_bench(fn, warmup=25, rep=200))
        import time

        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    def measure_ceilings(self) -> None:
        n = (1 << 30) if not self.smoke else (1 << 16)  # elements of bf16: 2 GiB on the GPU
        src = torch.empty(n, dtype=torch.bfloat16, device=self.device).normal_()
        dst = torch.empty_like(src)
        ms = self.time_ms(lambda: dst.copy_(src))
        self.copy_gb_s = 2 * n * 2 / (ms / 1e3) / GB
        size = 8192 if not self.smoke else 128
        a = torch.randn(size, size, dtype=torch.bfloat16, device=self.device)
        b = torch.randn(size, size, dtype=torch.bfloat16, device=self.device)
        ms = self.time_ms(lambda: a @ b)
        self.matmul_tflop_s = 2 * size**3 / (ms / 1e3) / TFLOP

    def add(
        self,
        kernel: str,
        shape: str,
        run: Callable[[], object],
        reference: Callable[[], object] | None,
        *,
        bytes_moved: float | None = None,
        flops: float | None = None,
        sdpa: Callable[[], object] | None = None,
        target: float,
    ) -> None:
        ms = self.time_ms(run)
        reference_ms = self.time_ms(reference) if reference is not None else None
        sdpa_ms = self.time_ms(sdpa) if sdpa is not None else None
        if bytes_moved is not None:
            rate, unit, ceiling = bytes_moved / (ms / 1e3) / GB, "GB/s", self.copy_gb_s
        else:
            rate, unit, ceiling = flops / (ms / 1e3) / TFLOP, "TFLOP/s", self.matmul_tflop_s
        row = Row(kernel, shape, ms, rate, unit, rate / ceiling, target, reference_ms, sdpa_ms)
        self.rows.append(row)
        print(f"  {kernel:<22} {shape:<34} {ms:9.3f} ms", file=sys.stderr, flush=True)


def bench_elementwise(bench: Bench) -> None:
    device, smoke = bench.device, bench.smoke
    tokens, hidden = (16384, 8192) if not smoke else (8, 64)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, dtype=torch.bfloat16, device=device)
    size = tokens * hidden * 2
    shape = f"{tokens}x{hidden} bf16"
    bench.add(
        "rms_norm", shape,
        lambda: rms_norm_triton(x, weight, 1e-6),
        lambda: rms_norm_torch(x, weight, 1e-6),
        bytes_moved=2 * size, target=0.70,
    )  # fmt: skip
    bench.add(
        "fused_add_rms_norm", shape,
        lambda: rms_norm_triton(x, weight, 1e-6, residual),
        lambda: rms_norm_torch(x, weight, 1e-6, residual),
        bytes_moved=4 * size, target=0.70,
    )  # fmt: skip

    width = 14336 if not smoke else 48
    gate_up = torch.randn(tokens, 2 * width, dtype=torch.bfloat16, device=device)
    moved = 3 * tokens * width * 2
    shape = f"{tokens}x2*{width} bf16"
    bench.add(
        "silu_and_mul", shape,
        lambda: silu_and_mul_triton(gate_up), lambda: silu_and_mul_torch(gate_up),
        bytes_moved=moved, target=0.70,
    )  # fmt: skip
    bench.add(
        "gelu_and_mul", shape,
        lambda: gelu_and_mul_triton(gate_up), lambda: gelu_and_mul_torch(gate_up),
        bytes_moved=moved, target=0.70,
    )  # fmt: skip

    heads, kv_heads, head_dim = (32, 8, 128) if not smoke else (4, 2, 16)
    q = torch.randn(tokens, heads, head_dim, dtype=torch.bfloat16, device=device)
    k = torch.randn(tokens, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    cos = torch.rand(tokens, 1, head_dim // 2, dtype=torch.bfloat16, device=device)
    sin = torch.rand_like(cos)
    # In place: repeated calls keep rotating the same buffers, which costs the same each time.
    moved = 2 * (q.numel() + k.numel()) * 2 + 2 * cos.numel() * 2
    bench.add(
        "rotary", f"{tokens}x({heads}+{kv_heads})x{head_dim} bf16",
        lambda: rotary_triton(q, k, cos, sin), lambda: rotary_torch(q, k, cos, sin),
        bytes_moved=moved, target=0.70,
    )  # fmt: skip

    block_size = 16
    num_blocks = triton.cdiv(tokens, block_size) * 2
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16,
                          device=device)  # fmt: skip
    v_cache = torch.zeros_like(k_cache)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    bench.add(
        "store_kvcache", f"{tokens}x{kv_heads}x{head_dim} bf16",
        lambda: store_kvcache_triton(k, v, k_cache, v_cache, slots),
        lambda: store_kvcache_torch(k, v, k_cache, v_cache, slots),
        bytes_moved=4 * k.numel() * 2, target=0.70,
    )  # fmt: skip


def paged_cache(batch, context, kv_heads, head_dim, block_size, device):
    """A cache holding `batch` sequences of `context` tokens in shuffled blocks."""
    blocks_per_seq = triton.cdiv(context, block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.randn(shape, dtype=torch.bfloat16, device=device)
    tables = torch.randperm(num_blocks, device=device).to(torch.int32).view(batch, blocks_per_seq)
    return k_cache, v_cache, tables


def gathered(cache, tables, context):
    """One sequence-major contiguous copy of the cache, [B, Hk, context, D], for SDPA."""
    batch = tables.shape[0]
    out = cache[tables.long()].reshape(batch, -1, *cache.shape[2:])[:, :context]
    return out.transpose(1, 2).contiguous()


def bench_decode_attention(bench: Bench) -> None:
    device, smoke = bench.device, bench.smoke
    batch, heads, kv_heads, head_dim, block_size = (64, 32, 8, 128, 16)
    contexts = [1024, 4096, 16384, 32768]
    if smoke:
        batch, heads, kv_heads, head_dim, contexts = 2, 4, 2, 16, [40]
    scale = head_dim**-0.5
    for context in contexts:
        k_cache, v_cache, tables = paged_cache(batch, context, kv_heads, head_dim, block_size,
                                               device)  # fmt: skip
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device=device)
        out = torch.empty_like(q)
        k, v = gathered(k_cache, tables, context), gathered(v_cache, tables, context)
        q4 = q.unsqueeze(2)
        moved = 2 * batch * context * kv_heads * head_dim * 2 + 2 * q.numel() * 2
        # The loop-per-sequence reference is only timed where it finishes in reasonable time.
        reference = None
        if context <= 4096 or smoke:

            def reference(q=q, k_cache=k_cache, v_cache=v_cache, tables=tables, lens=lens):
                return decode_attention_torch(q, k_cache, v_cache, tables, lens, scale)

        bench.add(
            "decode_attention", f"B{batch} H{heads}/{kv_heads} D{head_dim} ctx{context}",
            lambda q=q, kc=k_cache, vc=v_cache, t=tables, n=lens, o=out: decode_attention_triton(
                q, kc, vc, t, n, scale, out=o),
            reference,
            sdpa=lambda q4=q4, k=k, v=v: F.scaled_dot_product_attention(
                q4, k, v, scale=scale, enable_gqa=True),
            bytes_moved=moved, target=0.70,
        )  # fmt: skip
        del k_cache, v_cache, k, v


def bench_mla_decode(bench: Bench) -> None:
    device, smoke = bench.device, bench.smoke
    batch, heads, latent_dim, rope_dim, block_size = 64, 16, 512, 64, 16
    contexts = [1024, 4096, 16384, 32768]
    if smoke:
        batch, heads, latent_dim, rope_dim, contexts = 2, 4, 32, 8, [40]
    row = latent_dim + rope_dim
    scale = (128 + rope_dim) ** -0.5  # DeepSeek-V3 scales by its decompressed q/k head dim
    for context in contexts:
        blocks_per_seq = triton.cdiv(context, block_size)
        cache = torch.randn(batch * blocks_per_seq, block_size, row, dtype=torch.bfloat16,
                            device=device)  # fmt: skip
        tables = torch.randperm(batch * blocks_per_seq).view(batch, blocks_per_seq).tolist()
        step = build_paged_attention_batch(tables, [1] * batch, [context] * batch, block_size,
                                           device)  # fmt: skip
        step.kernel_batch()  # built once per step and shared by every layer: not timed
        q_latent = torch.randn(batch, heads, latent_dim, dtype=torch.bfloat16, device=device)
        q_rope = torch.randn(batch, heads, rope_dim, dtype=torch.bfloat16, device=device)
        out = torch.empty_like(q_latent)
        # SDPA over a contiguous gathered copy: heads as the query rows of one shared KV head.
        rows = cache.view(-1, row)[step.decode_slots.view(-1)].view(batch, 1, context, row)
        q4 = torch.cat([q_latent, q_rope], dim=-1).unsqueeze(1)
        # Each latent row is read once, ideally (its head blocks share it through L2).
        moved = batch * context * row * 2 + 2 * q_latent.numel() * 2 + q_rope.numel() * 2
        reference = None
        if context <= 4096 or smoke:

            def reference(ql=q_latent, qr=q_rope, cache=cache, step=step):
                return mla_decode_torch(ql, qr, cache, step, scale)

        bench.add(
            "mla_decode", f"B{batch} H{heads} R{latent_dim}+{rope_dim} ctx{context}",
            lambda ql=q_latent, qr=q_rope, c=cache, s=step, o=out: mla_decode_triton(
                ql, qr, c, s, scale, out=o),
            reference,
            sdpa=lambda q4=q4, rows=rows: F.scaled_dot_product_attention(
                q4, rows, rows[..., :latent_dim], scale=scale),
            bytes_moved=moved, target=0.70,
        )  # fmt: skip
        del cache, rows, step


def bench_extend_attention(bench: Bench) -> None:
    device, smoke = bench.device, bench.smoke
    batch, new, prefix, heads, kv_heads, head_dim, block_size = 8, 2048, 4096, 32, 8, 128, 16
    if smoke:
        batch, new, prefix, heads, kv_heads, head_dim = 2, 20, 33, 4, 2, 16
    scale = head_dim**-0.5
    context = prefix + new
    k_cache, v_cache, tables = paged_cache(batch, context, kv_heads, head_dim, block_size, device)
    tokens = batch * new
    q = torch.randn(tokens, heads, head_dim, dtype=torch.bfloat16, device=device)
    k = torch.randn(tokens, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    starts = torch.arange(0, tokens + 1, new, dtype=torch.int32, device=device)
    prefixes = torch.full((batch,), prefix, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    # Per sequence: every new token against the prefix, plus the causal triangle; QK and PV.
    flops = batch * heads * head_dim * 4 * (new * prefix + new * (new + 1) / 2)
    kg, vg = gathered(k_cache, tables, context), gathered(v_cache, tables, context)
    q4 = q.view(batch, new, heads, head_dim).transpose(1, 2)
    mask = torch.ones(new, context, dtype=torch.bool, device=device).tril(prefix)
    bench.add(
        "extend_attention", f"{batch}x{new} new over {prefix} H{heads}/{kv_heads} D{head_dim}",
        lambda: extend_attention_triton(q, k, v, k_cache, v_cache, tables, starts, prefixes,
                                        scale, out=out),
        lambda: extend_attention_torch(q, k, v, k_cache, v_cache, tables, starts, prefixes,
                                       scale),
        sdpa=lambda: F.scaled_dot_product_attention(q4, kg, vg, attn_mask=mask, scale=scale,
                                                    enable_gqa=True),
        flops=flops, target=0.40,
    )  # fmt: skip


def bench_fused_moe(bench: Bench) -> None:
    device, smoke = bench.device, bench.smoke
    tokens, experts, top_k, hidden, width = 4096, 64, 8, 2048, 1408
    if smoke:
        tokens, experts, top_k, hidden, width = 9, 4, 2, 32, 24
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=device)
    w13 = torch.randn(experts, 2 * width, hidden, dtype=torch.bfloat16, device=device) * 0.02
    w2 = torch.randn(experts, hidden, width, dtype=torch.bfloat16, device=device) * 0.02
    logits = torch.randn(tokens, experts, dtype=torch.float32, device=device)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    flops = tokens * top_k * 6 * hidden * width
    bench.add(
        "fused_moe", f"T{tokens} E{experts} top{top_k} H{hidden} I{width}",
        lambda: fused_moe_triton(x, w13, w2, weights, ids),
        lambda: fused_moe_torch(x, w13, w2, weights, ids),
        flops=flops, target=0.35,
    )  # fmt: skip


def ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def report(bench: Bench) -> dict:
    print(f"device: {torch.cuda.get_device_name() if bench.device == 'cuda' else 'cpu (smoke)'}")
    print(f"ceilings: copy {bench.copy_gb_s:,.0f} GB/s, bf16 matmul {bench.matmul_tflop_s:,.1f}"
          " TFLOP/s (measured in this run)")  # fmt: skip
    print()
    print("| kernel | shape | time (ms) | achieved | of ceiling | target | vs reference "
          "| vs SDPA | met |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for row in bench.rows:
        print(
            f"| {row.kernel} | {row.shape} | {row.ms:.3f} | {row.rate:,.1f} {row.unit} "
            f"| {row.ceiling_fraction:.0%} | ≥ {row.target_fraction:.0%} "
            f"| {ratio(row.vs_reference)} | {ratio(row.vs_sdpa)} "
            f"| {'yes' if row.met else 'no'} |"
        )
    return {
        "benchmark": "kernels",
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if bench.device == "cuda" else "cpu-smoke",
        # Four significant digits: a CPU smoke run's rates are small, not zero.
        "copy_gb_s": float(f"{bench.copy_gb_s:.4g}"),
        "matmul_tflop_s": float(f"{bench.matmul_tflop_s:.4g}"),
        "kernels": [
            {
                **asdict(row),
                "vs_reference": row.vs_reference,
                "vs_sdpa": row.vs_sdpa,
                "met": row.met,
            }
            for row in bench.rows
        ],
        "all_met": all(row.met for row in bench.rows),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, CPU, interpreter")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA device (use --smoke to check the script on the CPU)",
              file=sys.stderr)  # fmt: skip
        return 2
    device = "cpu" if args.smoke else "cuda"
    torch.manual_seed(0)
    bench = Bench(device, args.smoke)
    with torch.inference_mode():
        bench.measure_ceilings()
        bench_elementwise(bench)
        bench_decode_attention(bench)
        bench_mla_decode(bench)
        bench_extend_attention(bench)
        bench_fused_moe(bench)
    summary = report(bench)
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "kernels-smoke.json" if args.smoke else "kernels.json"
    (RESULTS / name).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
