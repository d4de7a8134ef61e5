"""Engine settings, with defaults that suit a CPU node."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


@dataclass
class EngineConfig:
    """How to run one model.

    `kv_cache_memory_bytes` is the budget the paged KV cache is sized from, in blocks of
    `block_size` tokens (`num_kv_blocks` sets the count directly instead);
    `max_num_batched_tokens` is the per-step token budget that chunked prefill respects;
    `max_model_len` caps prompt + output (default: the model's own context);
    `kv_wait_s`, `kv_remote_attempts`, `kv_hold_grace_s`: disaggregated prefill (Scheduler);
    `quantization="int4"` stores the decoder's projection weights in 4 bits (bfloat16 on the CPU
    only): single-sequence decoding, bound by reading the weights, reads a quarter of the bytes.
    """

    model: str = "SmolLM2-135M-Instruct"
    dtype: str = "bfloat16"
    block_size: int = 16
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    cache_dir: str | None = None
    device: str = "cpu"
    quantization: str | None = None
    # Disaggregated prefill, on a decode node (docs/disaggregation.md): how long a request waits
    # for its KV before it is asked again under a new epoch, how many remote attempts it gets
    # before it is prefilled here, and how long past a write's deadline its blocks stay held.
    kv_wait_s: float = 30.0
    kv_remote_attempts: int = 2
    kv_hold_grace_s: float = 5.0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"block_size must be 8, 16, 32 or 64, got {self.block_size}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.device != "cpu":
            # Weights and caches are placed on the CPU; the GPU path comes with the Triton kernels.
            raise ValueError(f"device must be 'cpu' for now, got {self.device!r}")
        if self.quantization not in (None, "int4"):
            raise ValueError(f"quantization must be None or 'int4', got {self.quantization!r}")
        if self.quantization == "int4" and (
            self.dtype not in ("bfloat16", "bf16") or self.device != "cpu"
        ):
            raise ValueError("quantization='int4' needs dtype bfloat16 on the CPU")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]
