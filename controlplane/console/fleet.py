"""The fleet page: every live node as its heartbeat shows it (controlplane/catalog/registry.py),
and `fleet.json`, the same rows, which the page reads every second to stay live.

Heartbeats are the nodes' own Redis keys, not events of an org, so they never travel over
/ws/events: the page polls. The fleet is shared by every org, so nothing here is org-scoped;
only the roles with the "fleet" permission see it.

A node beats every HEARTBEAT_INTERVAL_S (the nodes' `heartbeat_interval_s`, inference/node/
node.py) and each beat lives three intervals (inference/node/state.py `Heartbeats`). A node whose
last beat is older than STALE_AFTER_S has missed one: it shows as stale until its beat's TTL ends
and the registry forgets it. Its age is read from the beat's own `at` (the node's clock).
"""

from __future__ import annotations

import time
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.urls import path
from django.views.decorators.http import require_GET

from controlplane.catalog.registry import every_live_node, node_role
from controlplane.console.roles import console_view

HEARTBEAT_INTERVAL_S = 2.0
# One interval and a half: a beat a little late (a long engine step) is not yet a missed one.
STALE_AFTER_S = 1.5 * HEARTBEAT_INTERVAL_S
# How often the page reads fleet.json, in milliseconds.
POLL_MS = 1000


def node_row(state: dict[str, Any], now: float) -> dict[str, Any]:
    """One node's row: its identity, KV blocks, queue, prefix digest and how long ago it beat."""
    total, free = state.get("num_blocks", 0), state.get("free_blocks", 0)
    last_seen_s = max(now - state.get("at", 0.0), 0.0)
    return {
        "id": state["id"],
        "model": state.get("model", ""),
        "role": node_role(state),
        "blocks_total": total,
        "blocks_used": total - free,
        "blocks_free": free,
        "blocks_used_percent": round((total - free) * 100 / total) if total else 0,
        "running": state.get("running", 0),
        "waiting": state.get("waiting", 0),
        "prefix_blocks": len(state.get("prefix_blocks", ())),
        "last_seen_s": round(last_seen_s, 1),
        "state": "stale" if last_seen_s > STALE_AFTER_S else "live",
    }


def fleet_rows() -> list[dict[str, Any]]:
    """Every live node's row, by model then id."""
    now = time.time()
    rows = [node_row(state, now) for state in every_live_node()]
    return sorted(rows, key=lambda row: (row["model"], row["id"]))


@require_GET
@console_view("fleet")
def fleet(request: HttpRequest) -> HttpResponse:
    """The fleet's table; the page's script refreshes it from fleet.json."""
    context = {
        "nodes": fleet_rows(),
        "stale_after_s": STALE_AFTER_S,
        "heartbeat_interval_s": HEARTBEAT_INTERVAL_S,
        "poll_ms": POLL_MS,
    }
    return render(request, "console/fleet.html", context)


@require_GET
@console_view("fleet")
def fleet_json(request: HttpRequest) -> JsonResponse:
    """`{"object": "list", "data": [row, …], "stale_after_s"}`: what the page shows."""
    body = {"object": "list", "data": fleet_rows(), "stale_after_s": STALE_AFTER_S}
    response = JsonResponse(body)
    response["Cache-Control"] = "no-store"
    return response


urlpatterns = [
    path("fleet", fleet, name="fleet"),
    path("fleet.json", fleet_json, name="fleet-json"),
]
