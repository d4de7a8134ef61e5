"""Runs one scheduled step through the model: flatten the batch, forward, sample.

In a group (docs/parallelism.md) rank 0's runner sends each flattened step to the followers
before its own forward, and only it samples; a follower's runner runs the steps it receives
(`execute`). `on_every_rank` runs something else on every rank's runner (disaggregation's KV
transfer: each rank moves its own cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import kernels as ops
from inference.distributed.parallel import Parallel
from inference.distributed.rank_call import RankCall, attempt
from inference.engine.config import EngineConfig
from inference.engine.kv_cache import allocate_kv_buffer, layer_caches
from inference.engine.outputs import TokenLogprob
from inference.engine.sampler import sample
from inference.engine.scheduler import ScheduledSequence
from inference.engine.sequence import Sequence
from inference.models.decoder import DecoderModel, ForwardBatch
from inference.models.loader import load_weights
from inference.models.model_config import ModelConfig
from inference.structured.grammar import GrammarCompiler

if TYPE_CHECKING:
    from inference.distributed.group import RankGroup


@dataclass
class FlatStep:
    """One step's batch, flattened: everything a rank's forward reads, and nothing of the
    scheduler's state. `sample_rows` are the rows whose logits are computed and sampled."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]
    # The rank whose cache holds each sequence's blocks (data-parallel attention), else zeros.
    seq_ranks: list[int]

    @classmethod
    def empty(cls) -> FlatStep:
        return cls([], [], [], [], [], [], [], [])

    def for_rank(self, rank: int) -> FlatStep:
        """The part of the step whose sequences run on `rank` (data-parallel attention), its
        sampling rows renumbered; block tables and slots are that rank's own already."""
        local = FlatStep.empty()
        samples = set(self.sample_rows)
        start = 0
        for index, length in enumerate(self.query_lens):
            stop = start + length
            if self.seq_ranks[index] == rank:
                local.input_ids += self.input_ids[start:stop]
                local.positions += self.positions[start:stop]
                local.slot_mapping += self.slot_mapping[start:stop]
                local.query_lens.append(length)
                local.context_lens.append(self.context_lens[index])
                local.block_tables.append(self.block_tables[index])
                local.seq_ranks.append(rank)
                if stop - 1 in samples:
                    local.sample_rows.append(len(local.input_ids) - 1)
            start = stop
        return local

    def sample_ranks(self) -> list[int]:
        """The rank of each sampling row's sequence, in `sample_rows` order."""
        ends, owners = [], []
        for length, rank in zip(self.query_lens, self.seq_ranks, strict=True):
            ends.append((ends[-1] if ends else 0) + length)
            owners.append(rank)
        by_last_row = {end - 1: rank for end, rank in zip(ends, owners, strict=True)}
        return [by_last_row[row] for row in self.sample_rows]


class ModelRunner:
    """Owns the model weights (this rank's share of them) and the KV cache tensors."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        directory: Path,
        num_blocks: int,
        max_model_len: int,
        parallel: Parallel | None = None,
        group: RankGroup | None = None,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.parallel = parallel or Parallel.single()
        self.group = group
        self.device = torch.device(config.rank_device(self.parallel.rank))
        if config.deterministic and model_config.mla is not None:
            raise ValueError("deterministic mode does not cover MLA attention yet")
        with torch.inference_mode():
            self.model = DecoderModel(
                model_config, config.torch_dtype, max_model_len, self.parallel
            )
            load_weights(self.model, directory)
            self.model.pack_weights(config.quantization)
        self.kv_buffer = allocate_kv_buffer(
            model_config.for_rank(self.parallel),
            config.torch_dtype,
            num_blocks,
            config.block_size,
            str(self.device),
        )
        self.kv_caches = layer_caches(self.kv_buffer)
        # This rank's Transfer Engine over `kv_buffer`, once disaggregation opens one
        # (inference/disagg/transfer.py GroupTransfer).
        self.kv_transfer: Any = None

    def on_every_rank(self, call: RankCall) -> list[Any]:
        """`call(runner)` on every rank of the group (here alone on one device), the results in
        rank order; a rank where it raised gives `CallFailed` (inference/distributed/
        rank_call.py). A picklable call: followers are other processes."""
        if self.group is None:
            return [attempt(call, self)]
        return self.group.call(call, self)

    @torch.inference_mode()
    def run(
        self, scheduled: list[ScheduledSequence], grammars: GrammarCompiler | None = None
    ) -> tuple[list[Sequence], list[int], list[TokenLogprob | None]]:
        """Compute the scheduled tokens; sample for sequences whose last token was computed
        (`grammars`: the engine's compiler, when some sequence is constrained).

        Returns the sampling sequences with their new token ids and logprobs.
        """
        step, sampling = self.flatten(scheduled)
        # In a group, the followers are sent the step before this rank executes it.
        logits = self.execute(step) if self.group is None else self.group.run(step, self.execute)
        if logits is None:
            return [], [], []
        token_ids, logprobs = sample(logits.cpu(), sampling, grammars)
        return sampling, token_ids, logprobs

    def flatten(self, scheduled: list[ScheduledSequence]) -> tuple[FlatStep, list[Sequence]]:
        """The step's flat batch, and the sequences that sample (in `sample_rows` order)."""
        step = FlatStep.empty()
        sampling: list[Sequence] = []
        bs = self.block_size
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            step.input_ids.extend(seq.token_ids[start:end])
            step.positions.extend(range(start, end))
            table = seq.block_table
            step.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            step.query_lens.append(item.num_new_tokens)
            step.context_lens.append(end)
            step.block_tables.append(table)
            step.seq_ranks.append(seq.partition)
            if end == seq.num_tokens and not seq.prefill_only:
                step.sample_rows.append(len(step.input_ids) - 1)
                sampling.append(seq)
        return step, sampling

    @torch.inference_mode()
    def execute(self, step: FlatStep) -> torch.Tensor | None:
        """The forward over `step`, writing its KV; the float32 logits of its sampling rows
        ([rows, vocab]), or None when none samples. Every rank of a group runs it on the same
        step, so that the model's collectives pair up. In deterministic mode every op takes its
        batch-invariant path (kernels.batch_invariance)."""
        if self.parallel.data_parallel_attention:
            return self._execute_own_sequences(step)
        with ops.batch_invariant(self.config.deterministic):
            hidden = self._forward(step)
            if not step.sample_rows:
                return None
            rows = torch.tensor(step.sample_rows, dtype=torch.long, device=self.device)
            return self.model.compute_logits(hidden.index_select(0, rows))

    def _execute_own_sequences(self, step: FlatStep) -> torch.Tensor | None:
        """Data-parallel attention: the forward over this rank's sequences of `step` (or only
        the sparse layers' exchanges, when it has none), then every rank's sampling rows'
        hidden states gathered; rank 0 computes their logits (the LM head is whole on every
        rank), the followers return None."""
        parallel, model = self.parallel, self.model
        local = step.for_rank(parallel.rank)
        if local.input_ids:
            hidden = self._forward(local)
        else:
            model.idle()
            hidden = torch.empty(0, model.config.hidden_size, dtype=model.dtype)
        owners = step.sample_ranks()
        if not owners:
            return None
        counts = [owners.count(rank) for rank in range(parallel.world_size)]
        width = max(counts)
        mine = hidden.new_zeros(width, hidden.shape[1])
        if local.sample_rows:
            rows = torch.tensor(local.sample_rows, dtype=torch.long, device=self.device)
            mine[: len(local.sample_rows)] = hidden.index_select(0, rows)
        gathered = parallel.all_gather(mine, dim=0)  # rank r's rows at [r * width, ...)
        if parallel.rank != 0:
            return None
        taken = [0] * parallel.world_size
        order = []
        for rank in owners:
            order.append(rank * width + taken[rank])
            taken[rank] += 1
        index = torch.tensor(order, dtype=torch.long, device=self.device)
        return model.compute_logits(gathered.index_select(0, index))

    def _forward(self, step: FlatStep) -> torch.Tensor:
        """The model's hidden states over the tokens of `step`, its KV written."""
        position_ids = torch.tensor(step.positions, dtype=torch.long, device=self.device)
        rotary_cos, rotary_sin = self.model.rotary_tables(position_ids)
        batch = ForwardBatch(
            positions=position_ids,
            rotary_cos=rotary_cos,
            rotary_sin=rotary_sin,
            slot_mapping=torch.tensor(step.slot_mapping, dtype=torch.long, device=self.device),
            attention=ops.build_paged_attention_batch(
                step.block_tables, step.query_lens, step.context_lens, self.block_size, self.device
            ),
        )
        ids = torch.tensor(step.input_ids, dtype=torch.long, device=self.device)
        return self.model.forward(ids, batch, self.kv_caches)
