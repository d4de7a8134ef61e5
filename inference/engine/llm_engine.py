"""The online engine: add requests, step, abort. One instance serves one model."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from inference.distributed.group import RankGroup
from inference.engine.block_manager import BlockManager
from inference.engine.block_partitions import PartitionedBlockManager
from inference.engine.config import EngineConfig
from inference.engine.cpu_threads import CoreShare
from inference.engine.detokenizer import IncrementalDetokenizer
from inference.engine.fingerprint import system_fingerprint
from inference.engine.kv_cache import num_blocks_for_budget
from inference.engine.model_runner import ModelRunner
from inference.engine.outputs import (
    EngineStats,
    KVRequest,
    RequestOutput,
    Timings,
    TokenLogprob,
)
from inference.engine.sampling_params import SamplingParams
from inference.engine.scheduler import Scheduler
from inference.engine.sequence import Sequence, SequenceStatus
from inference.engine.tokenizer import Tokenizer
from inference.errors import InvalidRequestError
from inference.models.loader import resolve_model_directory
from inference.models.model_config import ModelConfig, read_hf_config
from inference.structured.grammar import GrammarCompiler


class LLMEngine:
    """Continuous-batching engine over a paged, prefix-cached KV cache.

    `add_request` queues a tokenized prompt; each `step()` runs one batch and returns a
    `RequestOutput` for every request that produced text or finished (including requests that
    were aborted or passed their deadline since the last step).

    With `tensor_parallel` > 1 this process is rank 0 of a group (docs/parallelism.md): it
    starts the other ranks, decides every step and samples; `close()` stops them. A rank that
    dies makes `step()` raise `GroupFailure`, and the engine is done.
    """

    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        self.config = config or EngineConfig(**overrides)
        cache_dir = Path(self.config.cache_dir) if self.config.cache_dir else None
        directory = resolve_model_directory(self.config.model, cache_dir)
        self.model_config = ModelConfig.from_hf(read_hf_config(directory))
        self.model_directory = directory
        # What responses report as `system_fingerprint` (inference/engine/fingerprint.py).
        self.system_fingerprint = system_fingerprint(self.config, directory)
        self.tokenizer = Tokenizer(directory)
        model_len = self.model_config.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or model_len, model_len)
        parallel = self.config.parallel(0)
        if parallel.expert_parallel > 1 and self.model_config.moe is None:
            raise ValueError("expert_parallel > 1 needs a mixture-of-experts model")
        moe = self.model_config.moe
        if parallel.data_parallel_attention and moe is not None and parallel.expert_parallel == 1:
            raise ValueError(
                "data-parallel attention sends each token to the rank holding its expert: set "
                f"expert_parallel to the group's size ({parallel.world_size})"
            )
        # Rank 0 decides the block count for the whole group, from one rank's share of the KV.
        num_blocks = self.config.num_kv_blocks or num_blocks_for_budget(
            self.model_config.for_rank(parallel),
            self.config.torch_dtype,
            self.config.block_size,
            self.config.kv_cache_memory_bytes,
        )
        if num_blocks < 2:
            raise ValueError(
                f"kv_cache_memory_bytes={self.config.kv_cache_memory_bytes} holds {num_blocks} "
                "blocks; at least 2 are needed"
            )
        if parallel.data_parallel_attention:
            # Each rank's cache holds its own sequences' KV: one pool per rank.
            self.block_manager = PartitionedBlockManager(
                parallel.world_size,
                num_blocks,
                self.config.block_size,
                self.config.enable_prefix_caching,
            )
        else:
            self.block_manager = BlockManager(
                num_blocks, self.config.block_size, self.config.enable_prefix_caching
            )
        self.scheduler = Scheduler(
            self.block_manager,
            self.config.max_num_batched_tokens,
            self.config.max_num_seqs,
            kv_wait_s=self.config.kv_wait_s,
            kv_hold_grace_s=self.config.kv_hold_grace_s,
            kv_remote_attempts=self.config.kv_remote_attempts,
        )
        # On the CPU, one process alone: as many threads as the other processes leave cores
        # free (cpu_threads.py), or the number the config fixes. A group divides the cores
        # between its ranks itself.
        self.core_share: CoreShare | None = None
        if self.config.device == "cpu" and not parallel.distributed:
            if self.config.cpu_threads is None:
                self.core_share = CoreShare()
            else:
                torch.set_num_threads(self.config.cpu_threads)
        self.group: RankGroup | None = None
        if parallel.distributed:
            self.group = RankGroup(
                self.config, self.model_config, directory, num_blocks, self.max_model_len
            )
        try:
            self.runner = ModelRunner(
                self.config,
                self.model_config,
                directory,
                num_blocks,
                self.max_model_len,
                parallel,
                self.group,
            )
            if self.group is not None:
                self.group.wait_ready()
        except BaseException:
            self.close()
            raise
        self.sequences: dict[str, Sequence] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.logprobs: dict[str, list[TokenLogprob]] = {}
        self.stop_token_ids: dict[str, set[int]] = {}
        self._finished_outside_step: list[Sequence] = []
        # Prefill-only sequences whose prompt is computed: their blocks wait for the node to
        # send them (`prefilled_blocks`), then `release_prefilled`.
        self.prefilled: dict[str, Sequence] = {}
        self._grammars: GrammarCompiler | None = None
        # The last step's batch: sequences it ran and tokens it computed (0, 0 when it ran none),
        # for the node's step metrics (inference/node/metrics.py).
        self.last_step_sequences = self.last_step_tokens = 0

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler over this model's vocabulary, built by the first constrained
        request (reading the vocabulary takes about a second)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.tokenizer.hf, self.model_config.vocab_size, self.tokenizer.eos_token_ids
            )
        return self._grammars

    # ---- requests -------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        namespace: str = "",
        deadline: float | None = None,
        remote_prefill: bool = False,
        prefill_only: bool = False,
    ) -> None:
        """Queue a request. `namespace` scopes its prefix-cache hits (the org); `deadline` is a
        wall-clock time (seconds since the epoch) after which it finishes with reason
        'deadline'. Raises InvalidRequestError for a request that can never be served.

        Disaggregated prefill (docs/disaggregation.md): `remote_prefill` has a prefill node
        compute the prompt's KV (`take_kv_requests`, then `kv_arrived`); `prefill_only`
        computes the prompt's KV for a decode node and samples nothing: the request finishes
        with reason 'prefilled', its blocks held until `release_prefilled`."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams", param="params")
        params.validate()
        if request_id in self.sequences:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        self._validate_prompt(prompt_token_ids)
        if (remote_prefill or prefill_only) and self.config.data_parallel_attention:
            raise InvalidRequestError(
                "this node serves with data-parallel attention, which does not take part in "
                "disaggregated prefill",
                param="prefill",
            )
        prompt_len = len(prompt_token_ids)
        room = self.max_model_len - prompt_len
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {prompt_len} tokens but the model's context length is "
                f"{self.max_model_len}",
                param="prompt",
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} cannot fit: the prompt has {prompt_len} tokens "
                f"and the context length is {self.max_model_len}, leaving room for {room}",
                param="max_tokens",
            )
        max_total = prompt_len + (params.max_tokens or room)
        blocks = -(-max_total // self.config.block_size)
        if blocks > self.block_manager.max_sequence_blocks:
            raise InvalidRequestError(
                f"the request needs up to {max_total} tokens of KV cache but this node's cache "
                f"holds {self.block_manager.max_sequence_blocks * self.config.block_size}",
                param="max_tokens",
            )
        vocab = self.model_config.vocab_size
        if any(token >= vocab for token in params.logit_bias):
            raise InvalidRequestError(
                f"logit_bias names a token id outside the vocabulary [0, {vocab})", "logit_bias"
            )
        seq = Sequence(request_id, prompt_token_ids, params, namespace, deadline)
        seq.remote_prefill = remote_prefill
        seq.prefill_only = prefill_only
        if params.structured is not None:
            seq.constraint = self.grammars.constraint(params.structured)
        self.sequences[request_id] = seq
        self.detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, params.stop
        )
        self.logprobs[request_id] = []
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= self.tokenizer.eos_token_ids
        self.stop_token_ids[request_id] = stops
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Stop a request now; the next `step()` reports it finished with reason 'abort'."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.finish(seq, "abort")
        self._finished_outside_step.append(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._finished_outside_step)

    def has_runnable_requests(self) -> bool:
        """Whether `step()` has something to compute or report now (requests awaiting their KV
        have not)."""
        return self.scheduler.has_runnable() or bool(self._finished_outside_step)

    # ---- disaggregated prefill ---------------------------------------------------------------
    def take_kv_requests(self) -> list[KVRequest]:
        """The requests that began awaiting their KV since the last call (each attempt once)."""
        requests = []
        for seq in self.scheduler.kv_requests:
            if seq.status != SequenceStatus.AWAITING_KV:
                continue  # aborted or expired meanwhile
            written = seq.num_prompt_tokens - 1
            last = seq.num_blocks_for(written, self.block_manager.block_size)
            requests.append(
                KVRequest(
                    request_id=seq.request_id,
                    epoch=seq.kv_epoch,
                    token_ids=seq.token_ids[:written],
                    first_block=seq.kv_first_block,
                    block_ids=seq.block_table[seq.kv_first_block : last],
                    cached_tokens=seq.kv_first_block * self.block_manager.block_size,
                    deadline=seq.kv_deadline,
                )
            )
        self.scheduler.kv_requests = []
        return requests

    def has_blocks_for(
        self, prompt_token_ids: list[int], max_tokens: int | None, namespace: str = ""
    ) -> bool:
        """Whether a request with this prompt and `max_tokens` would be admitted at once: none
        waits before it, and the blocks for its uncached prompt and its output are free."""
        if self.scheduler.waiting:
            return False
        seq = Sequence("", prompt_token_ids, SamplingParams(max_tokens=max_tokens), namespace)
        hits = self.block_manager.match_prefix(seq)
        computed = len(hits) * self.block_manager.block_size
        total = len(prompt_token_ids) + (max_tokens or 0)
        needed = self.block_manager.blocks_needed(seq, total - computed, hits)
        return needed <= self.block_manager.free_blocks_for(seq)

    def _awaiting(self, request_id: str, epoch: int) -> Sequence | None:
        seq = self.scheduler.awaiting_kv.get(request_id)
        return seq if seq is not None and seq.kv_epoch == epoch else None

    def kv_arrived(self, request_id: str, epoch: int, prefill_cached_tokens: int = 0) -> bool:
        """A prefill node wrote the KV of `request_id`'s attempt `epoch`: it runs on, its
        written blocks in the prefix cache. False for a stale epoch or a request that no longer
        awaits (a late or repeated prefill_done), which changes nothing. `prefill_cached_tokens`
        is the prefill node's own cache hit: the request's cached tokens are what no node
        computed for it, the larger of the two hits."""
        seq = self._awaiting(request_id, epoch)
        if seq is None:
            return False
        self.scheduler.kv_arrived(seq)
        self.block_manager.commit_computed_blocks(seq)
        seq.num_cached_tokens = max(seq.num_cached_tokens or 0, prefill_cached_tokens)
        return True

    def kv_failed(self, request_id: str, epoch: int) -> bool:
        """The prefill node refused attempt `epoch` (its layout differs, or it failed): prefill
        here. False for a stale epoch."""
        seq = self._awaiting(request_id, epoch)
        if seq is None:
            return False
        self.scheduler.retry_kv(seq, remote=False)
        return True

    def prefilled_blocks(self, request_id: str) -> list[int]:
        """The block table of a prefill-only request that finished 'prefilled'."""
        return self.prefilled[request_id].block_table

    def release_prefilled(self, request_id: str) -> None:
        """Free the blocks of a prefilled request (they stay in the prefix cache)."""
        seq = self.prefilled.pop(request_id, None)
        if seq is not None:
            self.block_manager.free(seq)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_awaiting_kv(self) -> int:
        return len(self.scheduler.awaiting_kv)

    def release_holds(self) -> int:
        """Free the held blocks whose hold has ended (each step does it too; an idle node
        calls this so that its free blocks come back without traffic)."""
        return self.block_manager.release_holds(time.time())

    def stats(self) -> EngineStats:
        """Load and cache figures for heartbeats and metrics."""
        manager, model = self.block_manager, self.runner.model
        return EngineStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_free_blocks=manager.num_free_blocks,
            num_blocks=manager.num_blocks,
            block_size=manager.block_size,
            prefix_cache_hit_tokens=manager.prefix_cache_hit_tokens,
            prefix_cache_query_tokens=manager.prefix_cache_query_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_awaiting_kv=len(self.scheduler.awaiting_kv),
            num_held_blocks=manager.num_held_blocks,
            num_kv_timeouts=self.scheduler.num_kv_timeouts,
            num_kv_fallbacks=self.scheduler.num_kv_fallbacks,
            expert_tokens=_as_list(model.expert_tokens()),
            last_step_expert_tokens=_as_list(model.expert_tokens(last_step=True)),
        )

    def cached_block_hashes(self, limit: int | None = None) -> list[bytes]:
        """The prefix block hashes this engine's cache can serve now, at most `limit` (for
        prefix-aware routing: the gateway computes a prompt's hashes with
        `compute_block_hashes`; BlockManager.cached_block_hashes says which come first)."""
        return self.block_manager.cached_block_hashes(limit)

    def close(self) -> None:
        """Stop the group's other ranks and leave the group (an engine of one rank holds
        nothing to release). The engine takes no more steps after it."""
        if self.group is not None:
            self.group.close()

    # ---- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; return news for every request that has some."""
        plan = self.scheduler.schedule()
        outputs = [self._final_output(seq) for seq in self._finished_outside_step + plan.finished]
        self._finished_outside_step = []
        self.last_step_sequences = len(plan.scheduled)
        self.last_step_tokens = plan.num_batched_tokens
        if not plan.scheduled:
            return outputs
        if self.core_share is not None:
            self.core_share.update()
        sampling, token_ids, logprobs = self.runner.run(plan.scheduled, self._grammars)
        now = time.time()
        for item in plan.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.commit_computed_blocks(seq)
            if seq.prefill_only and seq.num_computed_tokens == seq.num_tokens:
                outputs.append(self._prefilled(seq, now))
        for seq, token_id, logprob in zip(sampling, token_ids, logprobs, strict=True):
            outputs.append(self._append_token(seq, token_id, logprob, now))
        return outputs

    def _prefilled(self, seq: Sequence, now: float) -> RequestOutput:
        """A prefill-only request's prompt is computed: finished, its blocks kept."""
        self.scheduler.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "prefilled"
        seq.finished_time = now
        self.prefilled[seq.request_id] = seq
        return self._final_output(seq)

    def _append_token(
        self, seq: Sequence, token_id: int, logprob: TokenLogprob | None, now: float
    ) -> RequestOutput:
        seq.token_ids.append(token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if logprob is not None:
            self.logprobs[seq.request_id].append(logprob)
        detokenizer = self.detokenizers[seq.request_id]
        reason = None
        if token_id in self.stop_token_ids[seq.request_id] or (
            seq.constraint is not None and seq.constraint.finished
        ):
            reason = "stop"
        else:
            detokenizer.add_token(token_id)
            if detokenizer.stopped:
                reason = "stop"
        if reason is None and (
            (seq.params.max_tokens is not None and seq.num_output_tokens >= seq.params.max_tokens)
            or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            return self._final_output(seq, [token_id], [logprob] if logprob else [])
        return RequestOutput(
            request_id=seq.request_id,
            text=detokenizer.take_delta(final=False),
            token_ids=[token_id],
            finished=False,
            finish_reason=None,
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens or 0,
            completion_tokens=seq.num_output_tokens,
            logprobs=[logprob] if logprob else [],
        )

    def _final_output(
        self,
        seq: Sequence,
        new_token_ids: list[int] | None = None,
        new_logprobs: list[TokenLogprob] | None = None,
    ) -> RequestOutput:
        request_id = seq.request_id
        text = self.detokenizers[request_id].take_delta(final=True)
        del self.sequences[request_id], self.detokenizers[request_id]
        del self.logprobs[request_id], self.stop_token_ids[request_id]
        return RequestOutput(
            request_id=request_id,
            text=text,
            token_ids=new_token_ids or [],
            finished=True,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens or 0,
            completion_tokens=seq.num_output_tokens,
            logprobs=new_logprobs or [],
            timings=_timings(seq),
        )

    def _validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        bad = next(
            (t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None
        )
        if bad is not None:
            raise InvalidRequestError(
                f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})", param="prompt"
            )


def _timings(seq: Sequence) -> Timings:
    end = seq.finished_time or time.time()
    timings = Timings(e2e_s=end - seq.arrival_time)
    if seq.first_scheduled_time is not None:
        timings.queued_s = seq.first_scheduled_time - seq.arrival_time
    if seq.first_token_time is not None:
        timings.ttft_s = seq.first_token_time - seq.arrival_time
        if seq.num_output_tokens > 1:
            timings.tpot_s = (end - seq.first_token_time) / (seq.num_output_tokens - 1)
    return timings


def _as_list(counts: torch.Tensor | None) -> list[int] | None:
    return None if counts is None else counts.tolist()
