"""Engine settings, with defaults that suit a CPU node."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from inference.distributed.parallel import Parallel
from inference.engine.cpu_dtype import preferred_dtype
from kernels import fixed_order_matmul
from kernels.batch_invariance import matmul_rows_keep_their_bits

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

    `tensor_parallel` > 1 serves the model from a group of that many ranks, this process being
    rank 0 (docs/parallelism.md); `expert_parallel` is 1 (each expert split like a dense MLP) or
    the group's size (each rank holds whole experts); `distributed_backend` is None for gloo on
    the CPU, nccl on CUDA; `distributed_timeout_s` bounds how long rank 0 waits on a collective
    or a follower before the step fails. `kv_cache_memory_bytes` is each rank's budget.
    `data_parallel_attention` (a group whose experts are spread, `expert_parallel` = the group's
    size, or a dense model) has each rank run the attention of its own sequences, whole, over
    its own cache, and exchange tokens with the other ranks' experts by all-to-all.
    """

    model: str = "SmolLM2-135M-Instruct"
    # "auto": bfloat16 where the CPU multiplies bf16 natively, else float32 (cpu_dtype.py).
    dtype: str = "auto"
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
    tensor_parallel: int = 1
    expert_parallel: int = 1
    distributed_backend: str | None = None
    distributed_timeout_s: float = 300.0
    data_parallel_attention: bool = False
    # Threads for torch's ops on the CPU: None adapts them to the cores other processes leave
    # free (inference/engine/cpu_threads.py); a number fixes them.
    cpu_threads: int | None = field(default_factory=lambda: _env_threads())
    # Deterministic inference (docs/determinism.md): every op takes its batch-invariant path,
    # so a request's tokens and logprobs don't depend on what shares its steps or the cache.
    deterministic: bool = field(default_factory=lambda: _env_deterministic())

    def __post_init__(self) -> None:
        if self.dtype == "auto":
            # int4 weights are packed from bf16: they keep it wherever they are asked for.
            self.dtype = "bfloat16" if self.quantization == "int4" else preferred_dtype()
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
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be at least 1, got {self.tensor_parallel}")
        if self.expert_parallel not in (1, self.tensor_parallel):
            raise ValueError(
                f"expert_parallel must be 1 or tensor_parallel ({self.tensor_parallel}), "
                f"got {self.expert_parallel}"
            )
        if self.distributed_backend not in (None, "gloo", "nccl"):
            raise ValueError(
                "distributed_backend must be None, 'gloo' or 'nccl', "
                f"got {self.distributed_backend!r}"
            )
        if self.distributed_backend == "nccl" and not self.device.startswith("cuda"):
            raise ValueError("distributed_backend='nccl' needs a CUDA device")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {self.cpu_threads}")
        if self.data_parallel_attention and self.tensor_parallel == 1:
            raise ValueError("data_parallel_attention needs a group: set tensor_parallel > 1")
        if self.distributed_timeout_s <= 0:
            raise ValueError("distributed_timeout_s must be positive")
        if self.deterministic:
            self._check_deterministic()

    def _check_deterministic(self) -> None:
        if self.tensor_parallel > 1:
            raise ValueError("deterministic mode serves from one device for now: tensor_parallel 1")
        if not matmul_rows_keep_their_bits(self.torch_dtype):
            why = ""
            if self.torch_dtype == torch.float32:
                why = f" ({fixed_order_matmul.available() or 'its fixed-order kernels differ'})"
            raise ValueError(
                f"deterministic mode needs a dtype whose matmuls give a row the same bits in any "
                f"batch on this CPU; {self.dtype} does not here{why} (bfloat16 does on CPUs "
                "with native bf16, float32 where kernels/fixed_order_matmul.py builds: "
                "docs/determinism.md)"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def backend(self) -> str:
        """The torch.distributed backend of a group: as set, else nccl on CUDA, gloo on the CPU."""
        if self.distributed_backend is not None:
            return self.distributed_backend
        return "nccl" if self.device.startswith("cuda") else "gloo"

    def parallel(self, rank: int) -> Parallel:
        """How rank `rank` of this engine's group (rank 0 alone: one device) holds the model."""
        return Parallel(
            rank,
            self.tensor_parallel,
            self.expert_parallel,
            data_parallel_attention=self.data_parallel_attention,
        )

    def rank_device(self, rank: int) -> str:
        """The device rank `rank` of a group runs on: its own GPU on CUDA (`cuda:rank`)."""
        return f"cuda:{rank}" if self.device.startswith("cuda") else self.device


def _env_threads() -> int | None:
    """HEARTH_CPU_THREADS fixes the CPU thread count (unset or empty: adapt)."""
    value = os.environ.get("HEARTH_CPU_THREADS", "").strip()
    return int(value) if value else None


def _env_deterministic() -> bool:
    """HEARTH_DETERMINISTIC=1 (or true/yes/on) turns deterministic mode on."""
    value = os.environ.get("HEARTH_DETERMINISTIC", "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"HEARTH_DETERMINISTIC must be 1 or 0, got {value!r}")
