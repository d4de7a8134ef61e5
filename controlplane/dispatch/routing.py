"""Which queue a request goes to, so that agents' long, growing prompts keep hitting a cache.

Every decision has a name, stored on the job and counted with the tokens it hit (metrics.py):

- `affinity` / `affinity_failover` (an `x-session-affinity` header): the session's node. Its first
  node is the top of its rendezvous (highest-random-weight) ranking over the model's live nodes, so
  every gateway agrees without asking. When that node is dead or busy the session moves to the next
  fit node in its ranking and stays there (its node is kept in the routing state, renewed on every
  request), so it does not bounce back, cold, when the first node recovers. `affinity_failover`
  is a request that moved its session, or that is served off the first of its ranking.
- `prefix`: the node whose cache holds the longest prefix of the prompt, by the engine's own
  block hashes (`compute_block_hashes`, namespace the org, the node's block size), matched against
  the digests in the nodes' heartbeats and against where the gateways sent recent prompts (the
  heartbeat comes every 2 s; an agent's next turn often comes sooner).
  Equal matches (a system prompt every node caches) are broken by rendezvous on the prompt, as
  `spread` does.
- `least_loaded`: every node holding a prefix is busy: the least loaded fit node.
- `spread`: no node holds any block of the prompt: a fit node chosen by rendezvous on the prompt's
  deepest block hash, so new conversations spread evenly over the nodes (the stale loads of
  heartbeats would send a burst of them all to one "least loaded" node), and the gateway remembers
  it for the next turn.
- `shared`: nothing to choose from (no live node, every node busy without a prefix, or a prompt
  shorter than one block): the model's shared queue, which any node with room pulls.

A node is busy when its load, the larger of its sequence slots and KV blocks in use, is at or above
ROUTING_MAX_LOAD.

Only nodes that decode are routed to: a `prefill` node (catalog/registry.py) never takes a
generation request, and its free slots give no room to one. Whether a request's prompt is then
computed by a prefill node is decided after its route (disaggregation.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from controlplane.catalog.registry import PREFILL, RouteState, node_role, route_state
from inference.engine.block_hash import compute_block_hashes
from inference.protocol.heartbeat import DIGEST_HASH_BYTES
from inference.protocol.messages import model_queue, node_queue

AFFINITY, AFFINITY_FAILOVER = "affinity", "affinity_failover"
PREFIX, LEAST_LOADED, SPREAD, SHARED = "prefix", "least_loaded", "spread", "shared"
DECISIONS = (AFFINITY, AFFINITY_FAILOVER, PREFIX, LEAST_LOADED, SPREAD, SHARED)
DEFAULT_BLOCK_SIZE = 16  # the engine's default, for a heartbeat that does not say


def rendezvous_rank(session: str, node_ids: list[str]) -> list[str]:
    """`node_ids` best first for `session`."""

    def weight(node_id: str) -> bytes:
        return hashlib.blake2b(f"{session}\x00{node_id}".encode(), digest_size=8).digest()

    return sorted(node_ids, key=weight, reverse=True)


def node_load(node: dict[str, Any]) -> float:
    """The larger of the fractions of its sequence slots and its KV blocks in use (0 to 1)."""
    free_slots = node.get("free_slots", 0)
    slots = node.get("max_num_seqs") or free_slots + node.get("running", 0) + node.get("waiting", 0)
    slot_load = 1 - free_slots / slots if slots else 0.0
    num_blocks = node.get("num_blocks") or 0
    kv_load = 1 - node.get("free_blocks", 0) / num_blocks if num_blocks else 0.0
    return max(slot_load, kv_load)


def is_busy(node: dict[str, Any]) -> bool:
    return node_load(node) >= settings.ROUTING_MAX_LOAD


def decode_nodes(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Those of `nodes` that take generation requests: every role but prefill."""
    return [n for n in nodes if node_role(n) != PREFILL]


@dataclass(frozen=True)
class Route:
    """Where a request goes: a queue, the node when one was chosen, and why (`decision`).

    `cached_tokens`: the prompt tokens the chosen node is expected to serve from its prefix
    cache, when routing matched the prompt against the nodes (None: it did not look).
    `prefill_queue`: where the node asks for the prompt's prefill, when the request is split
    (disaggregation.py); None, the node prefills it itself."""

    queue: str
    node: str | None
    has_room: bool
    decision: str = SHARED
    cached_tokens: int | None = None
    prefill_queue: str | None = None


def choose_route(
    model: str,
    nodes: list[dict[str, Any]],
    session: str | None,
    prompt_token_ids: list[int] | None = None,
    namespace: str = "",
    state: RouteState | None = None,
) -> Route:
    """The route of a request to `model`, given the live `nodes` (heartbeat states, as
    `registry.live_nodes` returns them): by `session` when there is one, else by the prompt's
    cached prefix when `prompt_token_ids` are given (`namespace`: the org, the node's cache
    namespace), else the shared queue.

    `has_room` says whether the chosen node (or, on the shared queue, any node) reported free
    slots in its last heartbeat; `reject_if_busy` refuses the request when it is False. Prefill
    nodes among `nodes` are left out (`decode_nodes`)."""
    state = state if state is not None else route_state()
    nodes = decode_nodes(nodes)
    if session and nodes:
        return _affinity_route(model, nodes, session, state)
    if prompt_token_ids and nodes:
        return _prefix_route(model, nodes, prompt_token_ids, namespace, state)
    return _shared(model, nodes)


def _shared(model: str, nodes: list[dict[str, Any]]) -> Route:
    return Route(model_queue(model), None, any(n.get("free_slots", 0) > 0 for n in nodes), SHARED)


def _to_node(
    model: str, node: dict[str, Any], decision: str, cached_tokens: int | None = None
) -> Route:
    has_room = node.get("free_slots", 0) > 0
    return Route(node_queue(model, node["id"]), node["id"], has_room, decision, cached_tokens)


def _affinity_route(model: str, nodes: list[dict[str, Any]], session: str, state) -> Route:
    by_id = {n["id"]: n for n in nodes}
    ranking = rendezvous_rank(session, list(by_id))
    ttl_s = settings.ROUTING_SESSION_TTL_S
    current = state.session_node(model, session, ttl_s)
    if current in by_id and not is_busy(by_id[current]):
        chosen = current
    else:
        fit = [node_id for node_id in ranking if not is_busy(by_id[node_id])]
        # Every node busy: wait on the current node (its cache) if it lives, else the first.
        chosen = fit[0] if fit else current if current in by_id else ranking[0]
        if chosen != current:
            state.set_session_node(model, session, chosen, ttl_s)
    moved = current is not None and chosen != current
    decision = AFFINITY if chosen == ranking[0] and not moved else AFFINITY_FAILOVER
    return _to_node(model, by_id[chosen], decision)


def node_block_size(node: dict[str, Any]) -> int:
    """The block size of the node's KV cache, which its prefix hashes are computed over."""
    return node.get("block_size") or DEFAULT_BLOCK_SIZE


def prompt_block_hashes(
    nodes: list[dict[str, Any]], prompt_token_ids: list[int], namespace: str
) -> dict[int, list[bytes]]:
    """The prompt's full-block hashes for each block size among `nodes` (the engine's own
    function, `namespace` the org), as `prefix_matches` takes them."""
    return {
        size: compute_block_hashes(prompt_token_ids, size, namespace)
        for size in {node_block_size(n) for n in nodes}
    }


def digest_run(node: dict[str, Any], hashes: list[bytes]) -> int:
    """How many of `hashes`, from the first, the node's heartbeat digest holds."""
    cached = node.get("prefix_blocks") or frozenset()
    run = 0
    for block_hash in hashes:
        if block_hash[:DIGEST_HASH_BYTES] not in cached:
            break
        run += 1
    return run


def prefix_matches(
    model: str,
    nodes: list[dict[str, Any]],
    prompt_hashes: dict[int, list[bytes]],
    prompt_len: int,
    state,
) -> dict[str, int]:
    """Prompt tokens each node is expected to serve from its cache: the longest run of the
    prompt's leading blocks in its heartbeat digest, or up to the deepest block of a prompt
    recently routed to it (whose heartbeat may not show it yet), whichever is longer.
    `prompt_hashes` holds the prompt's block hashes for each block size; the last prompt token
    never counts, since the engine always recomputes it."""
    matches: dict[str, int] = {}
    routed_by_size: dict[int, list[str | None]] = {}
    for node in nodes:
        block_size = node_block_size(node)
        hashes = prompt_hashes[block_size][: (prompt_len - 1) // block_size]
        if block_size not in routed_by_size:
            routed_by_size[block_size] = state.routed_prefixes(model, hashes)
        run = digest_run(node, hashes)
        routed = routed_by_size[block_size]
        sent = max((i + 1 for i, n in enumerate(routed) if n == node["id"]), default=0)
        matches[node["id"]] = max(run, sent) * block_size
    return matches


def _prefix_route(
    model: str, nodes: list[dict[str, Any]], prompt_token_ids: list[int], namespace: str, state
) -> Route:
    prompt_hashes = prompt_block_hashes(nodes, prompt_token_ids, namespace)
    matches = prefix_matches(model, nodes, prompt_hashes, len(prompt_token_ids), state)
    fit = [n for n in nodes if not is_busy(n)]
    holders = [n for n in nodes if matches[n["id"]] > 0]
    # Longest prefix first; ties (a system prompt every node caches) by rendezvous on the
    # prompt, not by load: heartbeat loads are up to seconds old, and the least loaded node of
    # the last heartbeat would take every new conversation until the next.
    deepest = prompt_hashes[node_block_size(nodes[0])][-1:]
    spread = rendezvous_rank(deepest[0].hex() if deepest else "", [n["id"] for n in nodes])
    by_match = sorted(holders, key=lambda n: (-matches[n["id"]], spread.index(n["id"])))
    fit_holders = [n for n in by_match if not is_busy(n)]
    if fit_holders:
        chosen, decision = fit_holders[0], PREFIX
    elif holders and fit:
        chosen, decision = min(fit, key=lambda n: (node_load(n), n["id"])), LEAST_LOADED
    elif holders:
        chosen, decision = by_match[0], PREFIX  # all busy: wait where the cache is
    elif fit and deepest:
        chosen, decision = min(fit, key=lambda n: spread.index(n["id"])), SPREAD
    else:
        return _shared(model, nodes)
    # The next turn extends this prompt: remember where its blocks will be.
    full = prompt_hashes[node_block_size(chosen)]
    if full:
        state.remember_prefix(model, full[-1], chosen["id"], settings.ROUTING_PREFIX_TTL_S)
    # Matched before that memory, which would claim the whole prompt cached on it.
    return _to_node(model, chosen, decision, matches[chosen["id"]])
