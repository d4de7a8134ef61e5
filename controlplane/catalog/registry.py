"""Which nodes are up: read from their heartbeats (DESIGN §3).

Production: each node keeps `hearth:node:<id>` in Redis with a TTL, so a node that stops beating
disappears by itself. Embedded mode: the in-process node beats into a `MemoryHeartbeat`, which the
embedded server hands to `use_memory_heartbeat`. The gateway reads the registry on every request,
so it caches the read for NODE_REGISTRY_TTL_S (heartbeats come every 2 s anyway).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from django.conf import settings

from inference.node.heartbeat import NODE_KEY_PREFIX, MemoryHeartbeat

_lock = threading.Lock()
_memory: MemoryHeartbeat | None = None
_redis_client = None
_cache: tuple[float, dict[str, dict[str, Any]]] = (0.0, {})


def use_memory_heartbeat(heartbeat: MemoryHeartbeat | None) -> None:
    """Read nodes from an in-process heartbeat sink (embedded mode); None goes back to Redis."""
    global _memory, _cache
    with _lock:
        _memory, _cache = heartbeat, (0.0, {})


def _redis():
    global _redis_client
    if _redis_client is None:
        import redis

        _redis_client = redis.Redis.from_url(settings.REDIS_URL)
    return _redis_client


def _read_all() -> dict[str, dict[str, Any]]:
    if _memory is not None:
        return _memory.live_nodes()
    if not settings.REDIS_URL:
        return {}
    client = _redis()
    keys = list(client.scan_iter(match=NODE_KEY_PREFIX + "*", count=500))
    states = {}
    for raw in client.mget(keys) if keys else []:
        if raw is not None:  # expired between SCAN and MGET
            state = json.loads(raw)
            states[state["id"]] = state
    return states


def live_nodes(model: str) -> list[dict[str, Any]]:
    """Heartbeat states of the nodes serving `model`, freshest read at most TTL old."""
    global _cache
    now = time.monotonic()
    with _lock:
        read_at, states = _cache
        if now - read_at > settings.NODE_REGISTRY_TTL_S:
            states = _read_all()
            _cache = (now, states)
    return [s for s in states.values() if s.get("model") == model]
