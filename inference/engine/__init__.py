"""The inference engine: paged KV cache, prefix caching, continuous batching, sampling.

Offline: `LLM(model).generate(prompts, SamplingParams(...))`. Online: `LLMEngine.add_request`,
`step`, `abort`.
"""

from inference.engine.block_hash import compute_block_hashes
from inference.engine.config import EngineConfig
from inference.engine.llm import LLM
from inference.engine.llm_engine import LLMEngine
from inference.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from inference.engine.sampling_params import SamplingParams
from inference.errors import InvalidRequestError, ModelLoadError

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
