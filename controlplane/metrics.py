"""Prometheus metrics: the registry that `GET /metrics` exposes (gateway/metrics.py) and the
counters behind it. No HTTP here: settlement counts, the gateway's view reads.

Per model and route decision (the name routing stores on the job): requests, prompt tokens,
prompt tokens served from a node's prefix cache, and requests whose prompt a prefill node
computed (disaggregated). Settlement adds a job's usage once, after the commit that settles it (a
redelivered result settles nothing and counts nothing).

Per node, from the live heartbeats at scrape time: the live nodes of each model and role, and each
node's disaggregation counters (`disagg` in its heartbeat: what it prefilled, transferred and
reused, counted since it started, so a restart starts them again, as Prometheus's `rate` expects
of a counter). A node whose heartbeat has none (one older than disaggregation) reports none. An
MoE model's node also reports the tokens it routed to each expert (`expert_tokens`).

The worker counts and every gateway process answers scrapes, so a process's own counter would
hold only part of the total. In production the counters are a Redis hash per model,
`hearth:route:tokens:<model>`, which a collector reads at scrape time; in embedded mode they live
in the process, which runs both. None of these is per process, so none is a prometheus_client
`Counter` (whose value would depend on which gateway process Prometheus reached).
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

from django.conf import settings
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from controlplane.catalog.registry import (
    NODE_ROLES,
    ROUTE_KEY_PREFIX,
    every_live_node,
    node_role,
    redis_client,
)

TOKENS_KEY_PREFIX = ROUTE_KEY_PREFIX + "tokens:"
# Each counter field: its series and help text.
ROUTE_SERIES = {
    "requests": (
        "hearth_route_requests_total",
        "Completed requests, by the route decision that placed them.",
    ),
    "prompt_tokens": (
        "hearth_route_prompt_tokens_total",
        "Prompt tokens of completed requests, by route decision.",
    ),
    "cached_tokens": (
        "hearth_route_cached_tokens_total",
        "Prompt tokens served from a node's prefix cache, by route decision.",
    ),
    "disaggregated": (
        "hearth_route_disaggregated_requests_total",
        "Completed requests whose prompt a prefill node computed, by route decision.",
    ),
}
# Each field of a heartbeat's `disagg` counters: its series and help text.
DISAGG_SERIES = {
    "requests": (
        "hearth_disagg_requests_total",
        "Split requests the node served in its role (prefilled, or decoded), since it started.",
    ),
    "tokens_prefilled": (
        "hearth_disagg_tokens_prefilled_total",
        "Prompt tokens the node computed for split requests, since it started.",
    ),
    "tokens_transferred": (
        "hearth_disagg_tokens_transferred_total",
        "Tokens whose KV the node sent or received, since it started.",
    ),
    "blocks_transferred": (
        "hearth_disagg_blocks_transferred_total",
        "KV blocks the node sent or received, since it started.",
    ),
    "bytes_transferred": (
        "hearth_disagg_bytes_transferred_total",
        "KV bytes the node sent or received, since it started.",
    ),
    "transfer_seconds": (
        "hearth_disagg_transfer_seconds_total",
        "Seconds the node spent on KV transfers, since it started.",
    ),
    "blocks_reused": (
        "hearth_disagg_blocks_reused_total",
        "KV blocks not transferred because the decode node held them, since it started.",
    ),
    "fallbacks": (
        "hearth_disagg_fallbacks_total",
        "Split requests the decode node prefilled itself after all, since it started.",
    ),
}
_lock = threading.Lock()
_memory: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))


def count_route_tokens(completed: list[tuple[str, str, dict[str, Any], bool]]) -> None:
    """Add completed requests' prompt and cached tokens to their decisions' counters; each is
    `(model, decision, usage, disaggregated)`, the last whether a prefill node computed its
    prompt. One Redis round trip for all of them."""
    amounts: dict[tuple[str, str], int] = defaultdict(int)
    for model, decision, usage, disaggregated in completed:
        amounts[model, f"{decision}:requests"] += 1
        amounts[model, f"{decision}:prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
        amounts[model, f"{decision}:cached_tokens"] += int(usage.get("cached_tokens") or 0)
        amounts[model, f"{decision}:disaggregated"] += int(disaggregated)
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
    """{model: {decision: {requests, prompt_tokens, cached_tokens, disaggregated}}}, every
    process's counts."""
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
            counters.setdefault(model, {}).setdefault(decision, dict.fromkeys(ROUTE_SERIES, 0))
            counters[model][decision][field] = value
    return counters


class RouteCountersCollector(Collector):
    """The route counters as Prometheus counter families labelled by model and decision, read
    from their shared store at each scrape."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        counters = route_counters()
        for field, (name, help_text) in ROUTE_SERIES.items():
            family = CounterMetricFamily(name, help_text, labels=("model", "decision"))
            for model, decisions in sorted(counters.items()):
                for decision, values in sorted(decisions.items()):
                    family.add_metric((model, decision), values[field])
            yield family


class NodesCollector(Collector):
    """The live nodes per model and role, and each node's disaggregation counters labelled by
    model, node and role, read from the heartbeats at each scrape."""

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        nodes = sorted(every_live_node(), key=lambda n: (n.get("model", ""), n["id"]))
        live = GaugeMetricFamily(
            "hearth_nodes",
            "Live nodes (a heartbeat within its TTL), by model and role.",
            labels=("model", "role"),
        )
        per_role = Counter((node.get("model", ""), node_role(node)) for node in nodes)
        # Every role of a model with a live node, 0 included: an empty prefill pool shows.
        for model in sorted({model for model, _ in per_role}):
            for role in NODE_ROLES:
                live.add_metric((model, role), per_role[model, role])
        yield live
        for field, (name, help_text) in DISAGG_SERIES.items():
            family = CounterMetricFamily(name, help_text, labels=("model", "node", "role"))
            for node in nodes:
                counters = node.get("disagg")
                if isinstance(counters, dict) and field in counters:
                    labels = (node.get("model", ""), node["id"], node_role(node))
                    family.add_metric(labels, float(counters[field]))
            yield family
        experts = CounterMetricFamily(
            "hearth_node_expert_tokens_total",
            "MoE models: tokens the node routed to each expert, summed over its sparse layers, "
            "since it started (the load balance).",
            labels=("model", "node", "expert"),
        )
        for node in nodes:
            counts = node.get("expert_tokens")
            if isinstance(counts, list):
                for expert, count in enumerate(counts):
                    experts.add_metric((node.get("model", ""), node["id"], str(expert)), count)
        yield experts


# Hearth's own registry, not prometheus_client's default one: that one also carries this
# process's CPU, memory and garbage-collector figures, which differ per gateway process.
REGISTRY = CollectorRegistry()
REGISTRY.register(RouteCountersCollector())
REGISTRY.register(NodesCollector())
