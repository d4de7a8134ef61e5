"""One request split between two engines in the test's process, as the nodes split it: the
decode engine asks for its prompt's KV, the prefill engine computes it and writes the blocks
over the Transfer Engine, the decode engine generates from them."""

from __future__ import annotations

from inference.disagg.transfer import KVTransfer
from inference.engine import LLMEngine, SamplingParams


def generate_split(
    decode: LLMEngine,
    prefill: LLMEngine,
    transfers: tuple[KVTransfer, KVTransfer],
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
) -> list[int]:
    """The tokens `decode` generates for `prompt` from the KV `prefill` computed; `transfers`
    are (the prefill engine's, the decode engine's)."""
    ours, theirs = transfers
    decode.add_request(request_id, prompt, params, remote_prefill=True)
    decode.step()
    [kv] = decode.take_kv_requests()
    assert kv.token_ids == prompt[:-1]
    prefill.add_request(request_id, kv.token_ids, prefill_only=True)
    while prefill.has_unfinished_requests():
        for output in prefill.step():
            assert output.finish_reason == "prefilled" and not output.token_ids
    blocks = prefill.prefilled_blocks(request_id)[kv.first_block :]
    block_size = prefill.config.block_size
    last_tokens = len(kv.token_ids) - (kv.first_block + len(blocks) - 1) * block_size
    ours.write_blocks(theirs.region, blocks, kv.block_ids, last_tokens)
    prefill.release_prefilled(request_id)
    assert decode.kv_arrived(request_id, kv.epoch)
    tokens: list[int] = []
    while decode.has_unfinished_requests():
        for output in decode.step():
            tokens.extend(output.token_ids)
    return tokens
