"""The step protocol between rank 0 and its followers: one flattened batch per step, a call, or
stop.

Rank 0 decides every step (scheduler, block manager, prefix cache); the followers only need
what the model's forward reads: the flattened token ids, positions, slot mapping, query and
context lengths, block tables, which rows sample (every rank computes their logits, since
the LM head's collective must pair up; only rank 0 samples), and the rank whose cache holds each
sequence (data-parallel attention: each rank runs only its own). A step travels as two int64
broadcasts on the group's control group: a fixed header with the sizes, then one payload tensor
holding the lists end to end. Integers only, no pickling, and on CPU tensors, so the control
group is gloo whatever backend the model's collectives use.

A call (rank_call.py) travels as a header of its own kind, then the pickled callable; each
follower runs it on its runner and rank 0 gathers the results.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from inference.distributed.rank_call import RankCall, attempt
from inference.engine.model_runner import FlatStep, ModelRunner

_STOP, _STEP, _CALL = 0, 1, 2
# kind, tokens, sequences, block-table entries, sampled rows
_HEADER_SIZE = 5


def send_step(step: FlatStep, group) -> None:
    """Rank 0: send `step` to every follower (blocks until each has taken it)."""
    tables = step.block_tables
    header = [_STEP, len(step.input_ids), len(step.query_lens)]
    header += [sum(len(table) for table in tables), len(step.sample_rows)]
    payload = [
        *step.input_ids,
        *step.positions,
        *step.slot_mapping,
        *step.query_lens,
        *step.context_lens,
        *(len(table) for table in tables),
        *(block for table in tables for block in table),
        *step.sample_rows,
        *step.seq_ranks,
    ]
    dist.broadcast(torch.tensor(header, dtype=torch.long), src=0, group=group)
    dist.broadcast(torch.tensor(payload, dtype=torch.long), src=0, group=group)


def send_call(call: RankCall, group) -> None:
    """Rank 0: have every follower run `call` (then run it here, then `gather_results`)."""
    header = torch.zeros(_HEADER_SIZE, dtype=torch.long)
    header[0] = _CALL
    dist.broadcast(header, src=0, group=group)
    dist.broadcast_object_list([call], src=0, group=group)


def gather_results(result: Any, world_size: int, group) -> list[Any]:
    """Rank 0: its own `result` and each follower's, in rank order."""
    results: list[Any] = [None] * world_size
    dist.gather_object(result, results, dst=0, group=group)
    return results


def answer_call(runner: ModelRunner, group) -> None:
    """A follower, after a call's header: take the call, run it, send rank 0 the result."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    dist.gather_object(attempt(box[0], runner), None, dst=0, group=group)


def send_stop(group) -> None:
    """Rank 0: tell every follower to leave its step loop."""
    header = torch.zeros(_HEADER_SIZE, dtype=torch.long)
    header[0] = _STOP
    dist.broadcast(header, src=0, group=group)


def receive_step(group, runner: ModelRunner) -> FlatStep | None:
    """A follower: the next step rank 0 sends, or None when it says stop (answering any calls
    that come first with `runner`)."""
    header = torch.empty(_HEADER_SIZE, dtype=torch.long)
    dist.broadcast(header, src=0, group=group)
    kind, num_tokens, num_seqs, num_entries, num_samples = header.tolist()
    while kind == _CALL:
        answer_call(runner, group)
        dist.broadcast(header, src=0, group=group)
        kind, num_tokens, num_seqs, num_entries, num_samples = header.tolist()
    if kind == _STOP:
        return None
    payload = torch.empty(
        3 * num_tokens + 4 * num_seqs + num_entries + num_samples, dtype=torch.long
    )
    dist.broadcast(payload, src=0, group=group)
    values = payload.tolist()
    offset = 0

    def take(count: int) -> list[int]:
        nonlocal offset
        offset += count
        return values[offset - count : offset]

    input_ids, positions, slot_mapping = take(num_tokens), take(num_tokens), take(num_tokens)
    query_lens, context_lens, table_lens = take(num_seqs), take(num_seqs), take(num_seqs)
    block_tables = [take(length) for length in table_lens]
    return FlatStep(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=block_tables,
        sample_rows=take(num_samples),
        seq_ranks=take(num_seqs),
    )
