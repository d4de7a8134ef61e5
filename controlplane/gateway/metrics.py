"""`GET /metrics` in Prometheus's text format, and the route counters behind it.

Per model and route decision (gateway/routing.py): requests, prompt tokens and prompt tokens
served from a node's prefix cache. `record_completion` adds a job's usage once, after the commit
that settles it (a redelivered result settles nothing and counts nothing). In production the
counters are a Redis hash per model, `hearth:route:tokens:<model>`, shared by every worker and
read by every gateway; in embedded mode they live in the process, which runs both.
"""

from __future__ import annotations

import hmac
import threading
from collections import defaultdict
from typing import Any

from django.conf import settings
from django.http import HttpResponse

from controlplane.accounts.authentication import bearer_token
from controlplane.catalog.registry import ROUTE_KEY_PREFIX, redis_client
from controlplane.gateway.errors import ApiError

TOKENS_KEY_PREFIX = ROUTE_KEY_PREFIX + "tokens:"
FIELDS = ("requests", "prompt_tokens", "cached_tokens")
_lock = threading.Lock()
_memory: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))


def count_route_tokens(completed: list[tuple[str, str, dict[str, Any]]]) -> None:
    """Add completed requests' prompt and cached tokens to their decisions' counters; each is
    `(model, decision, usage)`. One Redis round trip for all of them."""
    amounts: dict[tuple[str, str], int] = defaultdict(int)
    for model, decision, usage in completed:
        amounts[model, f"{decision}:requests"] += 1
        amounts[model, f"{decision}:prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
        amounts[model, f"{decision}:cached_tokens"] += int(usage.get("cached_tokens") or 0)
    if settings.REDIS_URL:
        pipe = redis_client().pipeline(transaction=False)
        for (model, field), amount in amounts.items():
            pipe.hincrby(TOKENS_KEY_PREFIX + model, field, amount)
        pipe.execute()
        return
    with _lock:
        for (model, field), amount in amounts.items():
            _memory[model][field] += amount


def route_counters() -> dict[str, dict[str, dict[str, int]]]:
    """{model: {decision: {requests, prompt_tokens, cached_tokens}}}."""
    if settings.REDIS_URL:
        client = redis_client()
        keys = sorted(client.scan_iter(match=TOKENS_KEY_PREFIX + "*", count=500))
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        raw = {
            key.decode()[len(TOKENS_KEY_PREFIX) :]: {f.decode(): int(v) for f, v in h.items()}
            for key, h in zip(keys, pipe.execute() if keys else [], strict=True)
        }
    else:
        with _lock:
            raw = {model: dict(fields) for model, fields in _memory.items()}
    counters: dict[str, dict[str, dict[str, int]]] = {}
    for model, fields in raw.items():
        for name, value in fields.items():
            decision, _, field = name.rpartition(":")
            counters.setdefault(model, {}).setdefault(decision, dict.fromkeys(FIELDS, 0))
            counters[model][decision][field] = value
    return counters


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text() -> str:
    """The exposition: one counter family per field, labelled by model and decision."""
    counters = route_counters()
    lines = []
    for field, help_text in (
        ("requests", "Completed requests, by the route decision that placed them."),
        ("prompt_tokens", "Prompt tokens of completed requests, by route decision."),
        ("cached_tokens", "Prompt tokens served from a node's prefix cache, by route decision."),
    ):
        name = f"hearth_route_{field}_total"
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
        for model, decisions in sorted(counters.items()):
            for decision, values in sorted(decisions.items()):
                labels = f'model="{_label(model)}",decision="{_label(decision)}"'
                lines.append(f"{name}{{{labels}}} {values[field]}")
    return "\n".join(lines) + "\n"


def metrics(request) -> HttpResponse:
    """`GET /metrics`: for the operator's Prometheus. It names models and counts tokens of every
    org: with HEARTH_METRICS_TOKEN set it answers only that bearer token (401 otherwise);
    without, keep it off the public network (like the admin)."""
    if settings.METRICS_TOKEN:
        sent = bearer_token(request.headers.get("Authorization", "")) or ""
        if not hmac.compare_digest(sent.encode(), settings.METRICS_TOKEN.encode()):
            return ApiError(
                401, "GET /metrics needs the metrics token as a bearer token.", code="invalid_token"
            ).response()
    return HttpResponse(prometheus_text(), content_type="text/plain; version=0.0.4; charset=utf-8")
