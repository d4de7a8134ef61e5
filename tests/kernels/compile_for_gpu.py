"""Compile every Triton kernel for an H100/H200 (sm_90) ahead of time, without a GPU.

The CPU tests run the kernels in Triton's interpreter, which never compiles them and takes the
float32 branch (`COMPUTE_FP32`) that a GPU skips for bf16. This script runs each launch wrapper
on CPU tensors at realistic sizes with launching replaced by recording, then compiles each
recorded launch with the constexprs a GPU would get (`COMPUTE_FP32=False` for bf16/fp16) through
Triton's own compiler and `ptxas` (shipped in the triton wheel) for sm_90, and prints one JSON
line per kernel: registers, spills, shared memory. It must run without `TRITON_INTERPRET`.

    .venv/bin/python tests/kernels/compile_for_gpu.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("run without TRITON_INTERPRET: the interpreter never compiles")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from kernels.activation import gelu_and_mul_triton, silu_and_mul_triton
from kernels.attention import build_paged_attention_batch, store_kvcache_triton
from kernels.decode_attention import decode_attention_triton
from kernels.extend_attention import extend_attention_triton
from kernels.fused_moe import fused_moe_triton
from kernels.mla_attention import mla_decode_triton, mla_prefill_triton, store_latent_triton
from kernels.moe_router import select_experts_torch, select_experts_triton
from kernels.rms_norm import rms_norm_triton
from kernels.rotary import rotary_triton

TARGET = GPUTarget("cuda", 90, 32)
# sm_90's largest shared-memory allocation per block (227 KB).
MAX_SHARED_BYTES = 232_448
COMPILE_OPTIONS = ("num_warps", "num_stages", "num_ctas")
POINTER_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
}

launches: list[tuple[str, JITFunction, dict, dict, dict]] = []


def record(self: JITFunction, *args, grid, warmup, **kwargs):
    """Stands in for JITFunction.run: keeps the bound arguments instead of launching."""
    options = {k: kwargs.pop(k) for k in COMPILE_OPTIONS if k in kwargs}
    bound = self.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    launches.append((_current_case, self, dict(bound.arguments), options, {}))


JITFunction.run = record
_current_case = ""


def argument_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type {value!r}")


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, local memory (spills) and static shared memory, as `cuobjdump` reads them from
    the compiled binary (a CompiledKernel only counts them once loaded on a device)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run(
            [str(tool), "--dump-resource-usage", file.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    usage = dict(re.findall(r"(REG|LOCAL|STACK):(\d+)", report.split("Function", 1)[1]))
    return {key: int(value) for key, value in usage.items()}


def compile_launch(case: str, fn: JITFunction, arguments: dict, options: dict) -> dict:
    constexpr_names = {p.name for p in fn.params if p.is_constexpr}
    signature, constexprs = {}, {}
    low_precision = any(
        isinstance(v, torch.Tensor) and v.dtype in (torch.bfloat16, torch.float16)
        for v in arguments.values()
    )
    for name, value in arguments.items():
        if name in constexpr_names or value is None:
            if name == "COMPUTE_FP32" and low_precision:
                value = False  # what a CUDA launch passes for bf16/fp16 tensors
            signature[name], constexprs[name] = "constexpr", value
        else:
            signature[name] = argument_type(value)
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=TARGET,
        options={k: v for k, v in options.items() if v is not None},
    )
    usage = resource_usage(compiled.asm["cubin"])
    return {
        "case": case,
        "kernel": fn.__name__,
        "registers": usage["REG"],
        "local_bytes": usage["LOCAL"],  # register spills land here
        "shared_bytes": compiled.metadata.shared,
        "fits": compiled.metadata.shared <= MAX_SHARED_BYTES,
        "constexprs": {k: v for k, v in constexprs.items() if isinstance(v, bool | int)},
    }


def run_case(name: str, call) -> None:
    global _current_case
    _current_case = name
    call()


def mla_cases() -> None:
    """DeepSeek-V3's MLA: kv_lora_rank 512, rope dim 64, 128 heads; prefill heads of
    128 + 64 query/key dims and 128 value dims, 16 of them (one rank of eight)."""
    bf16 = torch.bfloat16
    latent_rows = torch.randn(64, 1536 + 576, dtype=bf16)  # fused q_a | kv_a projection
    cache = torch.randn(256, 16, 576, dtype=bf16)
    run_case(
        "store_latent",
        lambda: store_latent_triton(
            latent_rows[:, 1536:2048], latent_rows[:, 2048:], cache, torch.arange(64)
        ),
    )
    batch = build_paged_attention_batch(
        [list(range(row * 64, row * 64 + 63)) for row in range(4)], [1] * 4, [1000] * 4, 16
    )
    run_case(
        "mla_decode_h128",
        lambda: mla_decode_triton(
            torch.randn(4, 128, 512, dtype=bf16),
            torch.randn(4, 128, 64, dtype=bf16),
            cache,
            batch,
            192**-0.5,
        ),
    )
    query_starts = torch.tensor([0, 300, 600, 900, 1200], dtype=torch.int32)
    key_starts = torch.tensor([0, 800, 1600, 2400, 3200], dtype=torch.int32)
    run_case(
        "mla_prefill_h16",
        lambda: mla_prefill_triton(
            torch.randn(1200, 16, 192, dtype=bf16),
            torch.randn(3200, 16, 192, dtype=bf16),
            torch.randn(3200, 16, 128, dtype=bf16),
            query_starts,
            key_starts,
            192**-0.5,
        ),
    )


def main() -> int:
    bf16 = torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(64, 4096, dtype=bf16)
    weight = torch.randn(4096, dtype=bf16)
    run_case("rms_norm", lambda: rms_norm_triton(x, weight, 1e-6))
    run_case("fused_add_rms_norm", lambda: rms_norm_triton(x, weight, 1e-6, x.clone()))
    run_case("silu_and_mul", lambda: silu_and_mul_triton(torch.randn(64, 2 * 14336, dtype=bf16)))
    run_case("gelu_and_mul", lambda: gelu_and_mul_triton(torch.randn(64, 2 * 14336, dtype=bf16)))
    q = torch.randn(64, 32, 128, dtype=bf16)
    k = torch.randn(64, 8, 128, dtype=bf16)
    cos, sin = torch.rand(64, 1, 64, dtype=bf16), torch.rand(64, 1, 64, dtype=bf16)
    run_case("rotary", lambda: rotary_triton(q, k, cos, sin))
    run_case("rotary_interleaved", lambda: rotary_triton(q, k, cos, sin, True))
    k_cache = torch.randn(256, 16, 8, 128, dtype=bf16)
    v_cache = torch.randn_like(k_cache)
    slots = torch.arange(64)
    run_case("store_kvcache", lambda: store_kvcache_triton(k, k, k_cache, v_cache, slots))
    tables = torch.arange(256, dtype=torch.int32).view(4, 64)
    lens = torch.full((4,), 1000, dtype=torch.int32)
    starts = torch.tensor([0, 300, 600, 900, 1200], dtype=torch.int32)
    prefixes = torch.full((4,), 512, dtype=torch.int32)
    for head_dim in (128, 80):
        cache = torch.randn(256, 16, 8, head_dim, dtype=bf16)
        run_case(
            f"decode_attention_d{head_dim}",
            lambda cache=cache, d=head_dim: decode_attention_triton(
                torch.randn(4, 32, d, dtype=bf16), cache, cache, tables, lens, d**-0.5
            ),
        )
        run_case(
            f"extend_attention_d{head_dim}",
            lambda cache=cache, d=head_dim: extend_attention_triton(
                torch.randn(1200, 32, d, dtype=bf16),
                torch.randn(1200, 8, d, dtype=bf16),
                torch.randn(1200, 8, d, dtype=bf16),
                cache,
                cache,
                tables,
                starts,
                prefixes,
                d**-0.5,
            ),
        )
    mla_cases()
    for tokens in (4096, 16):  # many tokens per expert, and few (the small-tile config)
        hidden = torch.randn(tokens, 2048, dtype=bf16)
        w13 = torch.randn(64, 2 * 1408, 2048, dtype=bf16)
        w2 = torch.randn(64, 2048, 1408, dtype=bf16)
        weights, ids = select_experts_torch(torch.randn(tokens, 64), 8, renormalize=True)
        run_case(
            f"fused_moe_t{tokens}",
            lambda h=hidden, w13=w13, w2=w2, w=weights, i=ids: fused_moe_triton(h, w13, w2, w, i),
        )
    # DeepSeek-V3's router: 256 experts in 8 groups, the best 4 kept, top 8.
    router_logits = torch.randn(64, 256, dtype=bf16)
    run_case(
        "select_experts_deepseek_v3",
        lambda: select_experts_triton(
            router_logits,
            8,
            renormalize=True,
            scoring="sigmoid",
            correction_bias=torch.randn(256),
            num_expert_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
        ),
    )

    failures = 0
    for case, fn, arguments, options, _ in launches:
        try:
            result = compile_launch(case, fn, arguments, options)
        except Exception as error:  # reported per kernel, so one failure shows them all
            message = f"{type(error).__name__}: {error}"
            result = {"case": case, "kernel": fn.__name__, "error": message}
        failures += "error" in result or not result.get("fits", False)
        print(json.dumps(result), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
