"""A request as the engine tracks it: its tokens, its KV blocks, its progress and its timings."""

from __future__ import annotations

import enum
import time

import torch

from inference.engine.block_hash import hash_block
from inference.engine.sampling_params import SamplingParams
from inference.structured.grammar import Constraint


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    AWAITING_KV = "awaiting_kv"  # its prompt's blocks are allocated; a prefill node fills them
    FINISHED = "finished"


class Sequence:
    """One request. `token_ids` holds the prompt followed by the generated tokens.

    `num_computed_tokens` counts the tokens whose KV is in the cache; when it reaches
    `num_tokens` after a step, the step sampled a new token. A preempted sequence drops its blocks
    and starts again from zero, so recompute covers prompt and output alike.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        namespace: str = "",
        deadline: float | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.namespace = namespace
        self.deadline = deadline
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # The block pool its blocks come from: a rank's cache under data-parallel attention
        # (PartitionedBlockManager, chosen at each admission), else 0.
        self.partition = 0
        self.block_hashes: list[bytes] = []
        self.num_committed_blocks = 0
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        self.constraint: Constraint | None = None  # its grammar, when its output is constrained
        self.generator: torch.Generator | None = None
        # Disaggregated prefill (inference/disagg): on a prefill node, compute the prompt's KV
        # only (no sampling; the blocks stay held until the node has sent them); on a decode
        # node, wait for a prefill node to write the prompt's KV (`remote_prefill`), under a new
        # epoch at each attempt, until `kv_deadline`.
        self.prefill_only = False
        self.remote_prefill = False
        self.kv_epoch = 0
        self.kv_deadline: float | None = None
        self.kv_first_block = 0
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def num_blocks_for(self, num_tokens: int, block_size: int) -> int:
        return -(-num_tokens // block_size)

    def full_block_hashes(self, num_tokens: int, block_size: int) -> list[bytes]:
        """Hashes of the full blocks among the first `num_tokens` tokens (extends the chain)."""
        num_full = num_tokens // block_size
        while len(self.block_hashes) < num_full:
            index = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            chunk = self.token_ids[index * block_size : (index + 1) * block_size]
            self.block_hashes.append(hash_block(parent, chunk, self.namespace))
        return self.block_hashes[:num_full]

    def reset_for_recompute(self) -> None:
        """Forget the KV state after preemption; the tokens themselves are kept."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_committed_blocks = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1
