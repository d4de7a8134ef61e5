"""What the engine reports about a request after each step and at the end."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """The sampled token's log-probability and, if asked, the most likely alternatives."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Timings:
    """Seconds, measured on the engine's clock (wall time)."""

    queued_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None


@dataclass
class RequestOutput:
    """One step's news about a request: the new text and tokens, and at the end the totals."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)


@dataclass
class KVRequest:
    """A sequence awaiting its prompt's KV from a prefill node (disaggregated prefill): compute
    `token_ids` (the prompt but its last token) and write their blocks from `first_block` on
    into `block_ids` (the last one holding only the tokens up to the end of `token_ids`) before
    `deadline` (time.time()), under `epoch`."""

    request_id: str
    epoch: int
    token_ids: list[int]
    first_block: int
    block_ids: list[int]
    cached_tokens: int
    deadline: float


@dataclass
class CompletionOutput:
    """A finished request as the offline `LLM.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob]
    timings: Timings


@dataclass
class EngineStats:
    """What a node reports about its engine in heartbeats (docs/architecture.md)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    block_size: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    num_preemptions: int
    num_awaiting_kv: int = 0
    num_held_blocks: int = 0
    num_kv_timeouts: int = 0
    num_kv_fallbacks: int = 0
    # MoE models: tokens routed to each expert, summed over the sparse layers, since the engine
    # started and in its last step (the load balance); None for dense models.
    expert_tokens: list[int] | None = None
    last_step_expert_tokens: list[int] | None = None
