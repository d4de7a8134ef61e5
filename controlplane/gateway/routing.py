"""Which queue a request goes to.

Without `x-session-affinity`, the model's shared queue: any node with room pulls it. With it, the
queue of one node, chosen by rendezvous (highest-random-weight) hashing of the session over the
model's live nodes: every gateway picks the same node without sharing state, and when a node
joins or leaves only the sessions that ranked it first move.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from inference.node.protocol import model_queue, node_queue


def rendezvous_rank(session: str, node_ids: list[str]) -> list[str]:
    """`node_ids` best first for `session`."""

    def weight(node_id: str) -> bytes:
        return hashlib.blake2b(f"{session}\x00{node_id}".encode(), digest_size=8).digest()

    return sorted(node_ids, key=weight, reverse=True)


@dataclass(frozen=True)
class Route:
    """Where a request goes: a queue, and the node when one was chosen."""

    queue: str
    node: str | None
    has_room: bool


def choose_route(model: str, nodes: list[dict[str, Any]], session: str | None) -> Route:
    """The queue for a request to `model`, given the live `nodes` (heartbeat states).

    `has_room` says whether the chosen node (or, on the shared queue, any node) reported free
    slots in its last heartbeat; `reject_if_busy` refuses the request when it is False."""
    if session and nodes:
        [best, *_] = rendezvous_rank(session, [n["id"] for n in nodes])
        state = next(n for n in nodes if n["id"] == best)
        return Route(node_queue(model, best), best, state.get("free_slots", 0) > 0)
    return Route(model_queue(model), None, any(n.get("free_slots", 0) > 0 for n in nodes))
