"""Turn one step's logits into next tokens, each request with its own parameters.

Penalties and logit bias first, row by row; then each constrained row's grammar mask (its
forbidden tokens' logits become -inf; unconstrained rows are untouched). Greedy rows are one
batched argmax. Sampled rows are processed one by one (temperature, top-k, top-p, min-p, then a
draw from the request's own generator when it has a seed), which keeps a seeded request
reproducible whatever shares its batch. A constrained row's matcher then accepts its token.
"""

from __future__ import annotations

import torch

from inference.engine.outputs import TokenLogprob
from inference.engine.sequence import Sequence
from inference.structured.grammar import GrammarCompiler


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """Repetition (prompt and output), presence and frequency (output) penalties and the logit
    bias on one row."""
    params = seq.params
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        bias = torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
        logits = logits.index_add(0, ids, bias)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
        scores = logits.index_select(0, seen)
        scores = torch.where(
            scores > 0, scores / params.repetition_penalty, scores * params.repetition_penalty
        )
        logits = logits.index_copy(0, seen, scores)
    if (params.presence_penalty or params.frequency_penalty) and seq.num_output_tokens:
        output = torch.tensor(seq.output_token_ids, dtype=torch.long)
        counts = torch.bincount(output, minlength=logits.shape[0]).to(logits.dtype)
        logits = logits - params.frequency_penalty * counts
        logits = logits - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filtered_probs(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    params = seq.params
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[0]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= params.top_p
        probs = probs.index_fill(0, order[drop], 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs


def sample(
    logits: torch.Tensor, seqs: list[Sequence], grammars: GrammarCompiler | None = None
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Next token of each sequence (rows of float32 `logits` [N, vocab] in order). `grammars`
    is the engine's compiler, needed when a sequence has a constraint."""
    processed = logits
    constrained = [row for row, seq in enumerate(seqs) if seq.constraint is not None]
    if constrained or any(s.params.needs_penalties for s in seqs):
        # The raw logits stay untouched only when a request wants their logprobs.
        if any(s.params.logprobs for s in seqs):
            processed = logits.clone()
        for row, seq in enumerate(seqs):
            if seq.params.needs_penalties:
                processed[row] = apply_penalties(logits[row], seq)
    if constrained:
        bitmask = grammars.bitmask(len(constrained))
        for i, row in enumerate(constrained):
            seqs[row].constraint.fill_bitmask(bitmask, i)
        if len(constrained) == len(seqs):  # every row: masked in place
            grammars.apply(processed, bitmask)
        else:
            rows = torch.tensor(constrained, dtype=torch.long)
            masked = processed.index_select(0, rows)
            grammars.apply(masked, bitmask)
            processed.index_copy_(0, rows, masked)
    # max().indices picks the first maximum like argmax, and is faster on the CPU
    # (docs/performance.md).
    token_ids = processed.max(dim=-1).indices.tolist()
    for row, seq in enumerate(seqs):
        if not seq.params.greedy:
            probs = _filtered_probs(processed[row], seq)
            token_ids[row] = int(torch.multinomial(probs, 1, generator=seq.generator).item())
    for row in constrained:
        seqs[row].constraint.accept(token_ids[row])

    logprobs: list[TokenLogprob | None] = [None] * len(seqs)
    wanted = [row for row, seq in enumerate(seqs) if seq.params.logprobs]
    if wanted:
        # Log-probabilities of the model's own distribution, before penalties and sampling filters.
        log_probs = torch.log_softmax(logits[wanted], dim=-1)
        for i, row in enumerate(wanted):
            top_n = seqs[row].params.top_logprobs
            top: list[tuple[int, float]] = []
            if top_n:
                values, indices = log_probs[i].topk(top_n)
                top = list(zip(indices.tolist(), values.tolist(), strict=True))
            token = token_ids[row]
            logprobs[row] = TokenLogprob(token, float(log_probs[i, token]), top)
    return token_ids, logprobs
