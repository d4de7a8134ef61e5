"""Where a node's heartbeat goes: a Redis key with a TTL (production), or a dict (embedded).

A heartbeat carries a digest of the node's cached prefix blocks for prefix-aware routing: the
first `DIGEST_HASH_BYTES` bytes of each 16-byte block hash, concatenated and base64-encoded.
8 bytes is 11 characters of JSON per block where the full hex is 34 (a node caching 4,096 blocks
beats 44 KB instead of 139 KB). Two different prefixes that agree on 64 bits make the gateway
route a prompt as if its prefix were cached; the engine compares the full hash on admission, so
such a collision (about 1e-12 for a 100-block prompt against 4,096 cached blocks) costs one miss,
never a wrong answer.

The digest holds at most DIGEST_MAX_BLOCKS hashes (8,192: 87 KB of JSON, 131,072 tokens at 16 a
block): a GPU's cache holds hundreds of thousands of blocks, and every gateway process reads
every heartbeat. Past the bound it names the blocks in use, then the most recently freed ones
(BlockManager.cached_block_hashes): the last the cache would evict.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterable
from typing import Any

NODE_KEY_PREFIX = "hearth:node:"
# When each node last beat (epoch seconds), kept a day: a node whose state key expired may only
# be in a long step, and the sweeper tells that from a dead one by how long it has been quiet.
LAST_SEEN_PREFIX = "hearth:node-seen:"
LAST_SEEN_TTL_S = 24 * 3600
DIGEST_HASH_BYTES = 8
DIGEST_MAX_BLOCKS = 8192


def encode_prefix_digest(block_hashes: Iterable[bytes]) -> str:
    """The heartbeat's `cached_prefix_digest` for the hashes a node's prefix cache serves."""
    return base64.b64encode(b"".join(h[:DIGEST_HASH_BYTES] for h in block_hashes)).decode()


def decode_prefix_digest(digest: str) -> frozenset[bytes]:
    """The truncated hashes of a `cached_prefix_digest`; test a block hash `h` for membership
    with `h[:DIGEST_HASH_BYTES] in decoded`."""
    raw = base64.b64decode(digest)
    return frozenset(raw[i : i + DIGEST_HASH_BYTES] for i in range(0, len(raw), DIGEST_HASH_BYTES))


class RedisHeartbeat:
    """Writes `hearth:node:<id>` as JSON with a TTL: a node that stops beating disappears. Also
    `hearth:node-seen:<id>`, the time of the beat. A beat without a state (a draining node)
    deletes the first and writes the second: alive, but no gateway routes to it."""

    def __init__(self, client) -> None:
        self.client = client

    def __call__(self, node_id: str, state: dict[str, Any] | None, ttl_s: float) -> None:
        pipe = self.client.pipeline(transaction=False)
        if state is None:
            pipe.delete(NODE_KEY_PREFIX + node_id)
        else:
            pipe.set(NODE_KEY_PREFIX + node_id, json.dumps(state), px=int(ttl_s * 1000))
        pipe.set(LAST_SEEN_PREFIX + node_id, time.time(), ex=LAST_SEEN_TTL_S)
        pipe.execute()


class MemoryHeartbeat:
    """The same contract in one process, for embedded mode."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[str, tuple[float, dict[str, Any]]] = {}

    def __call__(self, node_id: str, state: dict[str, Any] | None, ttl_s: float) -> None:
        with self._lock:
            if state is None:
                self._states.pop(node_id, None)
            else:
                self._states[node_id] = (time.monotonic() + ttl_s, state)

    def live_nodes(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            return {k: s for k, (expiry, s) in self._states.items() if expiry > now}
