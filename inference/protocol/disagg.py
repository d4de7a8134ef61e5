"""The messages of disaggregated prefill (docs/disaggregation.md), as plain dicts.

A decode node that awaits a prompt's KV sends a `prefill` message to the prefill pool's queue
(`prefill.<model>`, or a prefill node's own `prefill.<model>.<node>`): a `PrefillRequest`. The
prefill node that takes it computes the KV of `token_ids` (the prompt but its last token),
writes the blocks from `first_block` on into the decode node's `block_ids` (of the last one only
the slots of those tokens; `kv` says where the decode node's cache lies) before `deadline`, and
answers with a `prefill_done` message on the decode node's control queue (`reply_queue`): a
`PrefillDone`, which names the attempt's `epoch`, so that an answer to an earlier attempt changes
nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class PrefillRequest:
    request_id: str  # the decode node's sequence id
    epoch: int
    org: str  # the prefix-cache namespace
    token_ids: list[int]
    first_block: int  # the first block the decode node does not hold
    block_ids: list[int]  # where blocks first_block, first_block + 1, … go on the decode node
    deadline: float  # time.time() after which nothing may be written
    reply_queue: str
    decode_node: str
    kv: dict[str, Any]  # the decode node's KVRegion.as_dict()

    def as_message(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_message(cls, body: dict[str, Any]) -> PrefillRequest:
        """KeyError or TypeError for a malformed message."""
        return cls(**{f.name: body[f.name] for f in dataclasses.fields(cls)})


@dataclass
class PrefillDone:
    request_id: str
    epoch: int
    prefill_node: str
    cached_tokens: int = 0  # what the prefill node's own cache held of the prompt
    tokens: int = 0  # the prompt tokens whose KV it wrote
    blocks: int = 0
    bytes: int = 0
    transfer_s: float = 0.0
    error: str | None = None  # the prefill node refused (layout) or failed: prefill locally

    def as_message(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_message(cls, body: dict[str, Any]) -> PrefillDone:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in body.items() if name in fields})


def disagg_counters() -> dict[str, Any]:
    """The cumulative figures every node's heartbeat carries under `disagg`."""
    return {
        "requests": 0,
        "tokens_prefilled": 0,
        "tokens_transferred": 0,
        "blocks_transferred": 0,
        "bytes_transferred": 0,
        "transfer_seconds": 0.0,
        "blocks_reused": 0,
        "fallbacks": 0,
    }
