"""One request split between two engines without the control plane, as the nodes split it: the
decode engine asks for its prompt's KV, a prefill engine computes it and writes the blocks over
the Transfer Engine, the decode engine generates from them.

The prefill engine runs here (`generate_split`) or, when both are groups (one torch.distributed
group per process), in a process of its own (`PrefillProcess`)."""

from __future__ import annotations

import contextlib
import multiprocessing
import traceback
from collections.abc import Callable

from inference.disagg.layout import KVRegion, kv_layout_of
from inference.disagg.transfer import GroupTransfer, KVTransfer
from inference.engine import EngineConfig, LLMEngine, SamplingParams
from inference.engine.outputs import KVRequest

# (the decode engine's KV request, the decode engine's region): compute and write its blocks.
Prefill = Callable[[KVRequest, KVRegion], None]


def prefill_and_write(
    prefill: LLMEngine,
    transfer: KVTransfer | GroupTransfer,
    kv: KVRequest,
    peer: KVRegion,
) -> None:
    """What a prefill node does with a prefill message: compute the prompt, write its blocks."""
    prefill.add_request(kv.request_id, kv.token_ids, prefill_only=True)
    while prefill.has_unfinished_requests():
        for output in prefill.step():
            assert output.finish_reason == "prefilled" and not output.token_ids
    blocks = prefill.prefilled_blocks(kv.request_id)[kv.first_block :]
    block_size = prefill.config.block_size
    last_tokens = len(kv.token_ids) - (kv.first_block + len(blocks) - 1) * block_size
    transfer.write_blocks(peer, blocks, kv.block_ids, last_tokens)
    prefill.release_prefilled(kv.request_id)


def generate_split_by(
    decode: LLMEngine,
    region: KVRegion,
    prefill: Prefill,
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
) -> list[int]:
    """The tokens `decode` (its cache at `region`) generates for `prompt` from the KV that
    `prefill` computed and wrote."""
    decode.add_request(request_id, prompt, params, remote_prefill=True)
    decode.step()
    [kv] = decode.take_kv_requests()
    assert kv.token_ids == prompt[:-1]
    prefill(kv, region)
    assert decode.kv_arrived(request_id, kv.epoch)
    tokens: list[int] = []
    while decode.has_unfinished_requests():
        for output in decode.step():
            tokens.extend(output.token_ids)
    return tokens


def generate_split(
    decode: LLMEngine,
    prefill: LLMEngine,
    transfers: tuple[KVTransfer | GroupTransfer, KVTransfer | GroupTransfer],
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
) -> list[int]:
    """The tokens `decode` generates for `prompt` from the KV `prefill` computed; `transfers`
    are (the prefill engine's, the decode engine's)."""
    ours, theirs = transfers
    return generate_split_by(
        decode,
        theirs.region,
        lambda kv, peer: prefill_and_write(prefill, ours, kv, peer),
        request_id,
        prompt,
        params,
    )


def _serve_prefills(config: EngineConfig, model: str, conn) -> None:
    """The prefill process: its engine's region first, then one answer per KV request."""
    engine = None
    try:
        engine = LLMEngine(config)
        transfer = GroupTransfer(engine, kv_layout_of(engine, model))
        conn.send(transfer.region.as_dict())
        while (message := conn.recv()) is not None:
            kv, peer = message
            prefill_and_write(engine, transfer, kv, KVRegion.from_dict(peer))
            conn.send("written")
    except BaseException:
        conn.send(traceback.format_exc())
        raise
    finally:
        if engine is not None:
            engine.close()


class PrefillProcess:
    """A prefill engine (a group, when `config.tensor_parallel` > 1) in a process of its own."""

    def __init__(self, config: EngineConfig, model: str) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, theirs = context.Pipe()
        # Not daemonic: its engine starts follower processes of its own.
        self.process = context.Process(target=_serve_prefills, args=(config, model, theirs))
        self.process.start()
        theirs.close()
        self.region = KVRegion.from_dict(self._answer())

    def _answer(self):
        if not self.conn.poll(120):
            raise TimeoutError("the prefill process did not answer")
        answer = self.conn.recv()
        if isinstance(answer, str) and answer != "written":
            raise RuntimeError(f"the prefill process failed:\n{answer}")
        return answer

    def __call__(self, kv: KVRequest, peer: KVRegion) -> None:
        self.conn.send((kv, peer.as_dict()))
        self._answer()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # it has died: joined below
            self.conn.send(None)
        self.process.join(30)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()
        self.conn.close()
