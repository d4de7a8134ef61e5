"""Writing KV blocks into a peer's cache with the Mooncake Transfer Engine.

Each node registers its whole KV buffer once (inference.engine.kv_cache lays it out so that a run
of consecutive blocks of one layer's keys is one run of bytes). A write of blocks coalesces runs
that are consecutive on both sides, so it sends 2 × layers × runs pieces, in batch calls of at
most MAX_BATCH_PIECES; the engine carries them over TCP here, RDMA or NVLink where the hardware
has them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from inference.disagg.layout import KVLayout, KVRegion

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
    """This node's transfer engine, its KV buffer registered once."""

    def __init__(self, buffer: torch.Tensor, layout: KVLayout, host: str = "127.0.0.1") -> None:
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
        self.region = KVRegion(
            endpoint=f"{host}:{self.engine.get_rpc_port()}",
            base=buffer.data_ptr(),
            num_blocks=buffer.shape[2],
            layout=layout,
        )

    def write_blocks(
        self, peer: KVRegion, src: list[int], dst: list[int], last_tokens: int | None = None
    ) -> WriteStats:
        """Write our blocks `src` into `peer`'s blocks `dst` (every layer, keys and values);
        of the last block only its first `last_tokens` token slots (default: all of them), so
        that the slots after a prompt's end, which the peer fills itself, are never touched.
        Raises TransferError when the engine reports a failure."""
        started = time.perf_counter()
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
                    theirs.append(peer.offset(layer, kind, dst_start))
                    lengths.append(length * block_bytes)
        if full_src is not src:
            for layer in range(layout.num_layers):
                for kind in range(layout.kinds):
                    ours.append(self.region.offset(layer, kind, src[-1]))
                    theirs.append(peer.offset(layer, kind, dst[-1]))
                    lengths.append(last_tokens * block_bytes // layout.block_size)
        for start in range(0, len(ours), MAX_BATCH_PIECES):
            end = start + MAX_BATCH_PIECES
            status = self.engine.batch_transfer_sync_write(
                peer.endpoint, ours[start:end], theirs[start:end], lengths[start:end]
            )
            if status != 0:
                raise TransferError(f"writing {len(src)} block(s) to {peer.endpoint} failed")
        return WriteStats(len(src), len(ours), sum(lengths), time.perf_counter() - started)
