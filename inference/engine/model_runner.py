"""Runs one scheduled step through the model: flatten the batch, forward, sample."""

from __future__ import annotations

from pathlib import Path

import torch

import kernels as ops
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


class ModelRunner:
    """Owns the model weights and the KV cache tensors."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        directory: Path,
        num_blocks: int,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.device = torch.device(config.device)
        with torch.inference_mode():
            self.model = DecoderModel(model_config, config.torch_dtype, max_model_len)
            load_weights(self.model, directory)
            self.model.pack_weights(config.quantization)
        self.kv_buffer = allocate_kv_buffer(
            model_config, config.torch_dtype, num_blocks, config.block_size, config.device
        )
        self.kv_caches = layer_caches(self.kv_buffer)

    @torch.inference_mode()
    def run(
        self, scheduled: list[ScheduledSequence], grammars: GrammarCompiler | None = None
    ) -> tuple[list[Sequence], list[int], list[TokenLogprob | None]]:
        """Compute the scheduled tokens; sample for sequences whose last token was computed
        (`grammars`: the engine's compiler, when some sequence is constrained).

        Returns the sampling sequences with their new token ids and logprobs.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_rows: list[int] = []
        sampling: list[Sequence] = []
        bs = self.block_size
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(item.num_new_tokens)
            context_lens.append(end)
            block_tables.append(table)
            if end == seq.num_tokens and not seq.prefill_only:
                sample_rows.append(len(input_ids) - 1)
                sampling.append(seq)
        position_ids = torch.tensor(positions, dtype=torch.long, device=self.device)
        rotary_cos, rotary_sin = self.model.rotary_tables(position_ids)
        batch = ForwardBatch(
            positions=position_ids,
            rotary_cos=rotary_cos,
            rotary_sin=rotary_sin,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=self.device),
            attention=ops.build_paged_attention_batch(
                block_tables, query_lens, context_lens, bs, self.device
            ),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden = self.model.forward(ids, batch, self.kv_caches)
        if not sampling:
            return [], [], []
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        token_ids, logprobs = sample(logits.cpu(), sampling, grammars)
        return sampling, token_ids, logprobs
