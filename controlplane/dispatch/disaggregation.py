"""Conditional disaggregation: whether a prefill node computes a request's prompt, decided per
request once its decode route is chosen (routing.py).

A split pays when prefilling the prompt on the decode node would stall the tokens of the requests
decoding beside it for longer than moving its KV costs. What counts is the part of the prompt the
decode node does not hold: a chat's next turn, whose history its node caches, is short however
long the chat. So a request is split only when

- its prompt tokens beyond what its decode node is expected to serve from its prefix cache
  (`Route.cached_tokens`, or `prefix_matches` on that node; none on the shared queue, where no
  node is chosen) number at least DISAGG_MIN_TOKENS, and
- the decode route is a `decode` node (a `unified` node prefills what it takes itself; on the
  shared queue, every live node that may take it is a decode node), and
- a live prefill node can pair with the decode node, and is not saturated. Pairing takes
  `kv_layout`s in both heartbeats that map (inference/protocol/kv_layout.py `layouts_pair`: the same
  model, dtype, block size, layers, KV heads and head dim, and groups of the same size, or MLA's
  latent cache between any sizes): the blocks are copied as they are, rank to rank. On the shared
  queue any decode node may take the request, so the prefill node must pair with every live
  decode node. Saturated: its load at or above
  ROUTING_MAX_LOAD, or DISAGG_MAX_QUEUED_TOKENS prompt tokens or more waiting on it.

Of those prefill nodes, the one whose heartbeat digest holds the longest prefix of the prompt (the
block hashes routing matches) takes it, then the one with the fewest queued tokens; the request
carries that node's own prefill queue. Otherwise it runs unified: an empty, saturated or
incompatible prefill pool only ever means the decode node prefills, never a refused request.

Unlike the decode route, the gateway does not remember where it sent a prompt's prefill: the
decode node registers the blocks it received, so the next turn finds its prefix there and its new
part is usually below the threshold.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from django.conf import settings

from controlplane.catalog.registry import DECODE, PREFILL, RouteState, node_role, route_state
from controlplane.dispatch.routing import (
    Route,
    decode_nodes,
    digest_run,
    is_busy,
    node_block_size,
    prefix_matches,
    prompt_block_hashes,
)
from inference.protocol.kv_layout import layouts_pair
from inference.protocol.messages import prefill_node_queue


def is_saturated(node: dict[str, Any]) -> bool:
    """Whether a prefill node should take no more prompts now: busy as routing counts it, or
    holding DISAGG_MAX_QUEUED_TOKENS prompt tokens or more that it has not computed yet."""
    queued = node.get("queued_tokens") or 0
    return is_busy(node) or queued >= settings.DISAGG_MAX_QUEUED_TOKENS


def split(
    model: str,
    nodes: list[dict[str, Any]],
    route: Route,
    prompt_token_ids: list[int],
    namespace: str,
    state: RouteState | None = None,
) -> Route:
    """`route` with `prefill_queue` set when a prefill node should compute the prompt (the module
    docstring says when and which), else `route` as it is. `nodes`: the model's live nodes of
    every role, as `registry.live_nodes` returns them; `namespace`: the org, the caches'."""
    prompt_len = len(prompt_token_ids)
    if prompt_len < settings.DISAGG_MIN_TOKENS:
        return route
    decoders = decode_nodes(nodes)
    if route.node is None:
        decode = None
        layouts = [n.get("kv_layout") for n in decoders]
        if any(node_role(n) != DECODE for n in decoders):
            layouts = []  # a unified node could take it, and prefills what it takes itself
    else:
        decode = next((n for n in decoders if n["id"] == route.node), None)
        fit = decode is not None and node_role(decode) == DECODE
        layouts = [decode.get("kv_layout")] if fit else []
    if not layouts:  # no decode node: nothing can pair
        return route
    candidates = [
        n
        for n in nodes
        if node_role(n) == PREFILL
        and all(layouts_pair(n.get("kv_layout"), layout) for layout in layouts)
        and not is_saturated(n)
    ]
    if not candidates:
        return route
    hashed = candidates if decode is None else [*candidates, decode]
    prompt_hashes = prompt_block_hashes(hashed, prompt_token_ids, namespace)
    cached = route.cached_tokens
    if cached is None:
        cached = 0
        if decode is not None:
            state = state if state is not None else route_state()
            cached = prefix_matches(model, [decode], prompt_hashes, prompt_len, state)[decode["id"]]
    if prompt_len - cached < settings.DISAGG_MIN_TOKENS:
        return route

    def cached_on(node: dict[str, Any]) -> int:
        size = node_block_size(node)
        return digest_run(node, prompt_hashes[size][: (prompt_len - 1) // size]) * size

    chosen = min(candidates, key=lambda n: (-cached_on(n), n.get("queued_tokens") or 0, n["id"]))
    return dataclasses.replace(route, prefill_queue=prefill_node_queue(model, chosen["id"]))
