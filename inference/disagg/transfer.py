"""Writing KV blocks into a peer's cache with the Mooncake Transfer Engine.

Each node registers its whole KV buffer once (inference.engine.kv_cache lays it out so that a run
of consecutive blocks of one layer's keys is one run of bytes). A write of blocks coalesces runs
that are consecutive on both sides, so it sends 2 × layers × runs pieces, in batch calls of at
most MAX_BATCH_PIECES; the engine carries them over TCP here, RDMA or NVLink where the hardware
has them.

A node that is a group of ranks (docs/parallelism.md) moves its cache rank by rank: each rank
registers its own buffer with a Transfer Engine of its own, in its own process (`GroupTransfer`
has every rank open one through the group's calls, inference/distributed/rank_call.py), and a
write is one call on every rank, each writing its blocks into the peer's ranks that hold the same
heads (`layout.head_routes`): whole blocks between groups of one size, one piece per token slot
where the peer's ranks hold more or fewer heads than ours; rank 0 returns once every rank's write
is done. Only rank 0 talks
to the broker: the followers receive nothing but these calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from inference.disagg.layout import HeadRoute, KVLayout, KVRegion, RankBuffer, head_routes
from inference.distributed.rank_call import CallFailed

# Mooncake's TCP transport refuses a batch of more than about 2,048 pieces (its per-peer queue),
# and after that refusal every later write to the same peer failed until the process restarted
# (measured with 0.3.13: 2,040 pieces went, 2,100 did not). A fragmented cache (after churn, a
# prompt's blocks are rarely consecutive) reaches that: SmolLM2 sends 60 pieces per run.
MAX_BATCH_PIECES = 1000


class TransferError(Exception):
    """The transfer engine could not start or could not complete a write."""


def contiguous_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """`src[i]` goes to `dst[i]`: the same as (src start, dst start, length) runs, each as long
    as both sides stay consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            start_s, start_d, length = runs[-1]
            runs[-1] = (start_s, start_d, length + 1)
        else:
            runs.append((s, d, 1))
    return runs


@dataclass
class WriteStats:
    blocks: int
    pieces: int
    bytes: int
    seconds: float


class KVTransfer:
    """One rank's transfer engine, its KV buffer registered once (a node of one rank: the
    node's). `rank`: its rank in a group whose ranks each hold a buffer laid out as `layout`."""

    def __init__(
        self, buffer: torch.Tensor, layout: KVLayout, host: str = "127.0.0.1", rank: int = 0
    ) -> None:
        from mooncake.engine import TransferEngine

        if not buffer.is_contiguous():
            raise ValueError("the KV buffer must be contiguous")
        self.buffer = buffer
        self.engine = TransferEngine()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise TransferError(f"the transfer engine could not start on {host}")
        nbytes = buffer.numel() * buffer.element_size()
        if self.engine.register_memory(buffer.data_ptr(), nbytes) != 0:
            raise TransferError("the transfer engine could not register the KV buffer")
        self.rank = rank
        self.buffer_ref = RankBuffer(f"{host}:{self.engine.get_rpc_port()}", buffer.data_ptr())
        # This rank's buffer alone (the node's region when it has one rank).
        self.region = KVRegion((self.buffer_ref,), buffer.shape[2], layout)

    def write_blocks(
        self, peer: KVRegion, src: list[int], dst: list[int], last_tokens: int | None = None
    ) -> WriteStats:
        """Write our blocks `src` into `peer`'s blocks `dst` (every layer, keys and values), in
        each of the peer's ranks this rank fills (`head_routes`: for one rank each side, its one
        buffer, whole blocks); of the last block only its first `last_tokens` token slots
        (default: all of them), so that the slots after a prompt's end, which the peer fills
        itself, are never touched. Raises TransferError when the engine reports a failure."""
        started = time.perf_counter()
        pieces = total = 0
        for route in head_routes(self.region.layout, peer.layout, self.rank):
            if route.whole:
                count, size = self._write_rank(peer, route.target, src, dst, last_tokens)
            else:
                count, size = self._write_heads(peer, route, src, dst, last_tokens)
            pieces, total = pieces + count, total + size
        return WriteStats(len(src), pieces, total, time.perf_counter() - started)

    def _write_heads(
        self,
        peer: KVRegion,
        route: HeadRoute,
        src: list[int],
        dst: list[int],
        last_tokens: int | None,
    ) -> tuple[int, int]:
        """Write `route`'s heads of each token slot into the peer's rank `route.target`, whose
        rows hold other heads too (groups of different sizes): one piece per token, layer and
        kind; the pieces and bytes written."""
        ours, theirs, lengths = [], [], []
        layout, peer_layout = self.region.layout, peer.layout
        head_bytes = layout.head_dim * layout.element_bytes
        row, peer_row = layout.num_kv_heads * head_bytes, peer_layout.num_kv_heads * head_bytes
        size = route.heads * head_bytes
        for index, (src_block, dst_block) in enumerate(zip(src, dst, strict=True)):
            last = index == len(src) - 1 and last_tokens is not None
            for token in range(last_tokens if last else layout.block_size):
                for layer in range(layout.num_layers):
                    for kind in range(layout.kinds):
                        ours.append(
                            self.region.offset(layer, kind, src_block)
                            + token * row
                            + route.src_head * head_bytes
                        )
                        theirs.append(
                            peer.offset(layer, kind, dst_block, route.target)
                            + token * peer_row
                            + route.dst_head * head_bytes
                        )
                        lengths.append(size)
        self._send(peer.ranks[route.target].endpoint, ours, theirs, lengths, len(src))
        return len(ours), sum(lengths)

    def _write_rank(
        self, peer: KVRegion, target: int, src: list[int], dst: list[int], last_tokens: int | None
    ) -> tuple[int, int]:
        """Write into the peer's rank `target`; the pieces and bytes written."""
        ours, theirs, lengths = [], [], []
        layout = self.region.layout
        block_bytes = layout.block_bytes
        full_src, full_dst = src, dst
        if last_tokens is not None and last_tokens < layout.block_size and src:
            full_src, full_dst = src[:-1], dst[:-1]
        for src_start, dst_start, length in contiguous_runs(full_src, full_dst):
            for layer in range(layout.num_layers):
                for kind in range(layout.kinds):
                    ours.append(self.region.offset(layer, kind, src_start))
                    theirs.append(peer.offset(layer, kind, dst_start, target))
                    lengths.append(length * block_bytes)
        if full_src is not src:
            for layer in range(layout.num_layers):
                for kind in range(layout.kinds):
                    ours.append(self.region.offset(layer, kind, src[-1]))
                    theirs.append(peer.offset(layer, kind, dst[-1], target))
                    lengths.append(last_tokens * block_bytes // layout.block_size)
        self._send(peer.ranks[target].endpoint, ours, theirs, lengths, len(src))
        return len(ours), sum(lengths)

    def _send(self, endpoint: str, ours: list, theirs: list, lengths: list, blocks: int) -> None:
        """Write the pieces, at most MAX_BATCH_PIECES a call."""
        for start in range(0, len(ours), MAX_BATCH_PIECES):
            end = start + MAX_BATCH_PIECES
            status = self.engine.batch_transfer_sync_write(
                endpoint, ours[start:end], theirs[start:end], lengths[start:end]
            )
            if status != 0:
                raise TransferError(f"writing {blocks} block(s) to {endpoint} failed")


@dataclass(frozen=True)
class _OpenTransfer:
    """On each rank: a Transfer Engine over the rank's cache (kept on its runner)."""

    layout: KVLayout
    host: str

    def __call__(self, runner) -> RankBuffer:
        rank = runner.parallel.rank
        runner.kv_transfer = KVTransfer(runner.kv_buffer, self.layout, self.host, rank)
        return runner.kv_transfer.buffer_ref


@dataclass(frozen=True)
class _WriteBlocks:
    """On each rank: write its blocks into the peer's ranks it fills."""

    peer: KVRegion
    src: list[int]
    dst: list[int]
    last_tokens: int | None

    def __call__(self, runner) -> WriteStats:
        return runner.kv_transfer.write_blocks(self.peer, self.src, self.dst, self.last_tokens)


class GroupTransfer:
    """A node's KV transfer over every rank of its engine (one rank or a group): `region` lists
    every rank's endpoint and buffer, and `write_blocks` has each rank write its part."""

    def __init__(self, engine, layout: KVLayout, host: str = "127.0.0.1") -> None:
        self.runner = engine.runner
        buffers = _results(self.runner.on_every_rank(_OpenTransfer(layout, host)))
        self.region = KVRegion(tuple(buffers), self.runner.kv_buffer.shape[2], layout)

    def write_blocks(
        self, peer: KVRegion, src: list[int], dst: list[int], last_tokens: int | None = None
    ) -> WriteStats:
        """KVTransfer.write_blocks on every rank at once; returns when all are written. Raises
        TransferError naming a rank whose write failed."""
        started = time.perf_counter()
        stats = _results(self.runner.on_every_rank(_WriteBlocks(peer, src, dst, last_tokens)))
        pieces, total = sum(s.pieces for s in stats), sum(s.bytes for s in stats)
        return WriteStats(len(src), pieces, total, time.perf_counter() - started)


def _results(results: list) -> list:
    failed = [r for r in results if isinstance(r, CallFailed)]
    if failed:
        raise TransferError("; ".join(f"rank {f.rank}: {f.error}" for f in failed))
    return results
