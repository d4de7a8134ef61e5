"""The dispatch point: CPU tensors run the reference, HEARTH_KERNELS forces a backend, and every
op the engine calls goes through it."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import kernels
from kernels import dispatch
from kernels.rms_norm import rms_norm_torch, rms_norm_triton


def run_with_kernels_env(value: str, code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["HEARTH_KERNELS"] = value
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_cpu_tensors_run_the_pytorch_reference():
    assert dispatch.select(kernels.RMS_NORM, torch.zeros(1)) is rms_norm_torch


def test_forcing_triton_on_the_cpu_runs_the_kernels_in_the_interpreter():
    code = (
        "import os, torch, kernels\n"
        "from kernels.rms_norm import rms_norm_triton\n"
        "assert os.environ['TRITON_INTERPRET'] == '1'\n"
        "assert kernels.dispatch.select(kernels.RMS_NORM, torch.zeros(1)) is rms_norm_triton\n"
        "x = torch.randn(3, 8)\n"
        "out, _ = kernels.rms_norm(x, torch.ones(8), 1e-6)\n"
        "print(torch.allclose(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))\n"
        "print(kernels.dispatch.select(kernels.LINEAR, x).__name__)\n"
    )
    result = run_with_kernels_env("triton", code)
    assert result.returncode == 0, result.stderr
    # linear stays on torch by design (cuBLAS's job on a GPU).
    assert result.stdout.split() == ["True", "linear_torch"]
    assert rms_norm_triton is not rms_norm_torch


def test_an_unknown_backend_is_a_clear_error():
    result = run_with_kernels_env("cuda", "import kernels")
    assert result.returncode != 0
    assert "HEARTH_KERNELS must be 'torch', 'triton' or 'auto', got 'cuda'" in result.stderr


def test_every_engine_op_goes_through_dispatch_with_a_triton_kernel():
    ops = {
        "rms_norm": kernels.RMS_NORM,
        "rotary": kernels.ROTARY,
        "silu_and_mul": kernels.SILU_AND_MUL,
        "gelu_and_mul": kernels.GELU_AND_MUL,
        "store_kvcache": kernels.STORE_KVCACHE,
        "attention": kernels.ATTENTION,
        "fused_moe": kernels.FUSED_MOE,
        "select_experts": kernels.SELECT_EXPERTS,
        "store_latent": kernels.STORE_LATENT,
        "mla_decode": kernels.MLA_DECODE,
        "mla_prefill": kernels.MLA_PREFILL,
    }
    assert set(ops) <= set(kernels.__all__)
    for name, op in ops.items():
        assert op.name == name and op.triton is not None, name
    assert kernels.LINEAR.triton is None and "linear" in dispatch.TORCH_ONLY_OPS
