"""The dispatch point: CPU tensors run the reference; forcing Triton without a kernel fails."""

from __future__ import annotations

import subprocess
import sys

import torch

import kernels
from kernels import dispatch
from kernels.rms_norm import rms_norm_torch


def test_cpu_tensors_run_the_pytorch_reference():
    assert dispatch.select("rms_norm", rms_norm_torch, torch.zeros(1)) is rms_norm_torch


def test_forcing_triton_for_an_op_without_a_kernel_is_a_clear_error():
    code = (
        "import torch, kernels\n"
        "try:\n"
        "    kernels.silu_and_mul(torch.zeros(2, 4))\n"
        "except NotImplementedError as e:\n"
        "    print(e)\n"
    )
    env = {"HEARTH_KERNELS": "triton", "PATH": "/usr/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert "HEARTH_KERNELS=triton but op 'silu_and_mul' has no Triton kernel yet" in out.stdout


def test_every_engine_op_goes_through_dispatch():
    names = {"rms_norm", "rotary", "silu_and_mul", "linear", "store_kvcache", "attention"}
    assert names <= set(kernels.__all__)
