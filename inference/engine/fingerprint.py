"""`system_fingerprint`: a short digest of everything that decides an engine's numbers.

OpenAI's responses carry this field so a client can tell whether two answers came from the same
backend configuration. Hearth's covers the model (its source and a digest of its weight files),
the dtype, the quantization, the kernel backend, deterministic mode, the engine's version, the
torch build and the CPU's vector instructions (oneDNN picks its kernels by them, so two machines
with different ones may round differently). Two responses with the same fingerprint came from
engines that compute the same way; in deterministic mode that means the same tokens and
logprobs for the same request (docs/determinism.md).

The weights digest reads each weight file's name and size and the first and last MiB of it
(a safetensors header lists every tensor's offsets, a GGUF's its tensors and metadata), not the
whole file: a 600 GB checkpoint would take minutes to hash at every start.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path

import torch

from inference.engine.config import EngineConfig
from inference.engine.cpu_dtype import NATIVE_BF16, cpu_flags
from kernels.dispatch import forced_backend

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")
_EDGE_BYTES = 1 << 20


def weights_digest(directory: Path) -> str:
    """A digest of the weight files under `directory` (names, sizes, first and last MiB)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(directory).rglob("*") if p.suffix in WEIGHT_SUFFIXES):
        size = path.stat().st_size
        digest.update(f"{path.relative_to(directory)}:{size}".encode())
        with path.open("rb") as file:
            digest.update(file.read(_EDGE_BYTES))
            if size > 2 * _EDGE_BYTES:
                file.seek(size - _EDGE_BYTES)
                digest.update(file.read(_EDGE_BYTES))
    return digest.hexdigest()


def engine_version() -> str:
    try:
        return metadata.version("hearth")
    except metadata.PackageNotFoundError:
        return "unknown"


def system_fingerprint(config: EngineConfig, directory: Path) -> str:
    """`fp_` and 12 hex digits over what decides the engine's numbers (see the module)."""
    decides = {
        "model": config.model,
        "weights": weights_digest(directory),
        "dtype": config.dtype,
        "quantization": config.quantization,
        "kernels": forced_backend() or ("triton" if config.device.startswith("cuda") else "torch"),
        "deterministic": config.deterministic,
        "tensor_parallel": config.tensor_parallel,
        "engine": engine_version(),
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "cpu_native_bf16": bool(cpu_flags() & NATIVE_BF16),
    }
    text = json.dumps(decides, sort_keys=True)
    return "fp_" + hashlib.sha256(text.encode()).hexdigest()[:12]
