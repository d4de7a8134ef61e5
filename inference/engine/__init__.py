"""The inference engine: paged KV cache, prefix caching, continuous batching, sampling.

Offline: `LLM(model).generate(prompts, SamplingParams(...))`. Online: `LLMEngine.add_request`,
`step`, `abort`.

The names below are loaded on first use (PEP 562), so that importing a light module of the
package (outputs, sampling_params: what the node protocol shares with the control plane) does
not import torch and transformers into the control plane's processes.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inference.engine.block_hash import compute_block_hashes
    from inference.engine.config import EngineConfig
    from inference.engine.llm import LLM
    from inference.engine.llm_engine import LLMEngine
    from inference.engine.outputs import CompletionOutput, EngineStats, RequestOutput
    from inference.engine.sampling_params import SamplingParams
    from inference.errors import InvalidRequestError, ModelLoadError

_WHERE = {
    "LLM": "inference.engine.llm",
    "CompletionOutput": "inference.engine.outputs",
    "EngineConfig": "inference.engine.config",
    "EngineStats": "inference.engine.outputs",
    "InvalidRequestError": "inference.errors",
    "LLMEngine": "inference.engine.llm_engine",
    "ModelLoadError": "inference.errors",
    "RequestOutput": "inference.engine.outputs",
    "SamplingParams": "inference.engine.sampling_params",
    "compute_block_hashes": "inference.engine.block_hash",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "InvalidRequestError",
    "LLMEngine",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
    "compute_block_hashes",
]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'inference.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
