"""Which nodes are up, and where the gateways last sent each session and prefix.

Production: each node keeps `hearth:node:<id>` in Redis with a TTL, so a node that stops beating
disappears by itself. Embedded mode: the in-process node beats into a `MemoryHeartbeat`, which the
embedded server hands to `use_memory_heartbeat`. The gateway reads the registry on every request,
so it caches the read for NODE_REGISTRY_TTL_S (heartbeats come every 2 s anyway), and decodes each
node's prefix digest once per read.

The routing state (`RouteState`) is shared by every gateway process through Redis, and held in
the process in embedded mode: a session's current node, and the node each recently routed prompt
went to (its deepest full block), which bridges the seconds before that node's heartbeat shows
the prompt's blocks.

Every heartbeat names its node's role (`NODE_ROLES`): a `unified` node prefills and decodes its
own requests; with disaggregation (docs/disaggregation.md) a `prefill` node only computes prompts
for `decode` nodes, which take generation requests as unified nodes do. A heartbeat without a
role comes from a node older than the roles: unified.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import Any

from django.conf import settings

from inference.protocol.heartbeat import (
    LAST_SEEN_PREFIX,
    NODE_KEY_PREFIX,
    MemoryHeartbeat,
    decode_prefix_digest,
)

_lock = threading.Lock()
_memory: MemoryHeartbeat | None = None
_redis_client = None
_cache: tuple[float, dict[str, dict[str, Any]]] = (0.0, {})
_memory_route_state: MemoryRouteState | None = None

ROUTE_KEY_PREFIX = "hearth:route:"
UNIFIED, PREFILL, DECODE = "unified", "prefill", "decode"
NODE_ROLES = (UNIFIED, PREFILL, DECODE)


def use_memory_heartbeat(heartbeat: MemoryHeartbeat | None) -> None:
    """Read nodes from an in-process heartbeat sink (embedded mode); None goes back to Redis.
    Either way the process's routing state starts afresh."""
    global _memory, _cache, _memory_route_state
    with _lock:
        _memory, _cache, _memory_route_state = heartbeat, (0.0, {}), None


def redis_client():
    """The process's client of REDIS_URL (production mode only)."""
    global _redis_client
    if _redis_client is None:
        import redis

        _redis_client = redis.Redis.from_url(settings.REDIS_URL)
    return _redis_client


def _with_digest(state: dict[str, Any]) -> dict[str, Any]:
    """The state with its prefix digest decoded (`prefix_blocks`), copied: a memory heartbeat's
    dict belongs to its node."""
    return {**state, "prefix_blocks": decode_prefix_digest(state.get("cached_prefix_digest", ""))}


def _read_all() -> dict[str, dict[str, Any]]:
    if _memory is not None:
        return {k: _with_digest(s) for k, s in _memory.live_nodes().items()}
    if not settings.REDIS_URL:
        return {}
    client = redis_client()
    keys = list(client.scan_iter(match=NODE_KEY_PREFIX + "*", count=500))
    states = {}
    for raw in client.mget(keys) if keys else []:
        if raw is not None:  # expired between SCAN and MGET
            state = json.loads(raw)
            states[state["id"]] = _with_digest(state)
    return states


def every_live_node() -> list[dict[str, Any]]:
    """Heartbeat states of every live node, of every model, freshest read at most TTL old; each
    with `prefix_blocks`, the truncated hashes of its cached prefix blocks (heartbeat.py)."""
    global _cache
    now = time.monotonic()
    with _lock:
        read_at, states = _cache
        if now - read_at > settings.NODE_REGISTRY_TTL_S:
            states = _read_all()
            _cache = (now, states)
    return list(states.values())


def live_nodes(model: str) -> list[dict[str, Any]]:
    """Heartbeat states of the nodes serving `model`, as `every_live_node` reads them."""
    return [s for s in every_live_node() if s.get("model") == model]


def node_role(state: dict[str, Any]) -> str:
    """A heartbeat's role (`NODE_ROLES`); unified for a node that does not say."""
    return state.get("role") or UNIFIED


def seen_within(node_ids: list[str], seconds: float) -> set[str]:
    """Those of `node_ids` that beat in the last `seconds`, live now or not (a node inside a
    long step misses its heartbeat's TTL but is no dead node). Embedded mode keeps no history:
    the live ones."""
    if _memory is not None:
        return set(node_ids) & set(_memory.live_nodes())
    if not settings.REDIS_URL or not node_ids:
        return set()
    beats = redis_client().mget([LAST_SEEN_PREFIX + node_id for node_id in node_ids])
    now = time.time()
    return {n for n, at in zip(node_ids, beats, strict=True) if at and now - float(at) < seconds}


def _session_key(model: str, session: str) -> str:
    # Hashed: a session id is the client's own string, of any length.
    digest = hashlib.blake2b(session.encode(), digest_size=16).hexdigest()
    return f"session:{model}:{digest}"


def _prefix_key(model: str, block_hash: bytes) -> str:
    return f"prefix:{model}:{block_hash.hex()}"


class RedisRouteState:
    """Routing state in Redis, shared by every gateway process; keys under `prefix`."""

    def __init__(self, client, prefix: str = ROUTE_KEY_PREFIX) -> None:
        self.client = client
        self.prefix = prefix

    def session_node(self, model: str, session: str, ttl_s: float) -> str | None:
        """The session's current node, its TTL renewed; None when it has none."""
        node = self.client.getex(self.prefix + _session_key(model, session), px=int(ttl_s * 1000))
        return node.decode() if node is not None else None

    def set_session_node(self, model: str, session: str, node: str, ttl_s: float) -> None:
        self.client.set(self.prefix + _session_key(model, session), node, px=int(ttl_s * 1000))

    def routed_prefixes(self, model: str, block_hashes: list[bytes]) -> list[str | None]:
        """For each block hash, the node a prompt ending with that block was last sent to."""
        if not block_hashes:
            return []
        keys = [self.prefix + _prefix_key(model, h) for h in block_hashes]
        return [n.decode() if n is not None else None for n in self.client.mget(keys)]

    def remember_prefix(self, model: str, block_hash: bytes, node: str, ttl_s: float) -> None:
        self.client.set(self.prefix + _prefix_key(model, block_hash), node, px=int(ttl_s * 1000))


class MemoryRouteState:
    """The same contract in one process (embedded mode)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[float, str]] = {}

    def _get(self, key: str, ttl_s: float | None = None) -> str | None:
        now = time.monotonic()
        with self._lock:
            expiry, node = self._entries.get(key, (0.0, ""))
            if expiry <= now:
                self._entries.pop(key, None)
                return None
            if ttl_s is not None:
                self._entries[key] = (now + ttl_s, node)
            return node

    def _set(self, key: str, node: str, ttl_s: float) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._entries) > 100_000:  # no Redis TTL to expire them: sweep now and then
                self._entries = {k: e for k, e in self._entries.items() if e[0] > now}
            self._entries[key] = (now + ttl_s, node)

    def session_node(self, model: str, session: str, ttl_s: float) -> str | None:
        return self._get(_session_key(model, session), ttl_s)

    def set_session_node(self, model: str, session: str, node: str, ttl_s: float) -> None:
        self._set(_session_key(model, session), node, ttl_s)

    def routed_prefixes(self, model: str, block_hashes: list[bytes]) -> list[str | None]:
        return [self._get(_prefix_key(model, h)) for h in block_hashes]

    def remember_prefix(self, model: str, block_hash: bytes, node: str, ttl_s: float) -> None:
        self._set(_prefix_key(model, block_hash), node, ttl_s)


RouteState = RedisRouteState | MemoryRouteState


def route_state() -> RouteState:
    """The process's routing state: Redis in production, in memory in embedded mode."""
    global _memory_route_state
    if _memory is None and settings.REDIS_URL:
        return RedisRouteState(redis_client())
    with _lock:
        if _memory_route_state is None:
            _memory_route_state = MemoryRouteState()
        return _memory_route_state
