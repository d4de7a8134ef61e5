"""Where a node's heartbeat goes: a Redis key with a TTL (production), or a dict (embedded)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

NODE_KEY_PREFIX = "hearth:node:"


class RedisHeartbeat:
    """Writes `hearth:node:<id>` as JSON with a TTL: a node that stops beating disappears."""

    def __init__(self, client) -> None:
        self.client = client

    def __call__(self, node_id: str, state: dict[str, Any], ttl_s: float) -> None:
        self.client.set(NODE_KEY_PREFIX + node_id, json.dumps(state), px=int(ttl_s * 1000))


class MemoryHeartbeat:
    """The same contract in one process, for embedded mode."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[str, tuple[float, dict[str, Any]]] = {}

    def __call__(self, node_id: str, state: dict[str, Any], ttl_s: float) -> None:
        with self._lock:
            self._states[node_id] = (time.monotonic() + ttl_s, state)

    def live_nodes(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            return {k: s for k, (expiry, s) in self._states.items() if expiry > now}
