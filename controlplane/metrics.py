"""Prometheus metrics: the registry that `GET /metrics` exposes (gateway/metrics.py) and the
counters behind it. No HTTP here: settlement counts, the gateway's view reads.
docs/observability.md lists every series of every process.

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

`SharedFamily` generalises that store to any counter or histogram family: the gateway's request
series (gateway/request_metrics.py) and the settled jobs' (jobs/job_metrics.py). Each family is a
Redis hash, `<broker namespace>:metrics:<series>`, one field per label set (and per bucket), that
every process adds to and any process reads at scrape time, so whichever gateway process answers,
it answers for all of them; prometheus_client's multiprocess mode would sum the processes of one
host only, and needs a directory per kind of process, emptied at each start. The amounts wait in
the process until `flush_shared`: the worker flushes after each settlement's commit, in the round
trip that adds the route counters; a gateway process every second, from a thread (`flush_every`),
so a request pays no round trip for its metrics.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

from django.conf import settings
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from controlplane.catalog.registry import (
    NODE_ROLES,
    ROUTE_KEY_PREFIX,
    every_live_node,
    node_role,
    redis_client,
)

logger = logging.getLogger(__name__)
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


def count_route_tokens(
    completed: list[tuple[str, str, dict[str, Any], bool]], pipe: Any = None
) -> None:
    """Add completed requests' prompt and cached tokens to their decisions' counters; each is
    `(model, decision, usage, disaggregated)`, the last whether a prefill node computed its
    prompt. One Redis round trip for all of them; none of its own when `pipe`, a Redis pipeline
    the caller executes, is given."""
    amounts: dict[tuple[str, str], int] = defaultdict(int)
    for model, decision, usage, disaggregated in completed:
        amounts[model, f"{decision}:requests"] += 1
        amounts[model, f"{decision}:prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
        amounts[model, f"{decision}:cached_tokens"] += int(usage.get("cached_tokens") or 0)
        amounts[model, f"{decision}:disaggregated"] += int(disaggregated)
    if settings.REDIS_URL:
        own = pipe is None
        pipe = redis_client().pipeline(transaction=False) if own else pipe
        for (model, field), amount in amounts.items():
            pipe.hincrby(TOKENS_KEY_PREFIX + model, field, amount)
        if own:
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


class SharedFamily:
    """A counter family (no `buckets`) or a histogram family whose amounts every process adds
    to one store (module docstring). `labels`: the label names; each `inc`/`observe` names their
    values in that order."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: tuple[str, ...],
        buckets: Iterable[float] | None = None,
    ) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        self.bounds = None if buckets is None else (*sorted(buckets), math.inf)

    def inc(self, labels: tuple[str, ...], amount: int = 1) -> None:
        """Add `amount` to the counter of `labels`."""
        _note(self.name, json.dumps(labels), amount)

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        """One observation of `value` into the histogram of `labels`."""
        bound = self.bounds[bisect.bisect_left(self.bounds, value)]
        _note(self.name, json.dumps([*labels, floatToGoString(bound)]), 1)
        _note(self.name, json.dumps([*labels, "sum"]), float(value))

    def metric(self, fields: dict[str, float]) -> Metric:
        """The family as Prometheus reads it, from its stored fields."""
        labels = list(self.labels)
        if self.bounds is None:
            family = CounterMetricFamily(self.name, self.documentation, labels=labels)
            for field, value in sorted(fields.items()):
                family.add_metric(json.loads(field), value)
            return family
        counts: dict[tuple[str, ...], dict[str, float]] = defaultdict(dict)
        for field, value in fields.items():
            *values, part = json.loads(field)
            counts[tuple(values)][part] = value
        family = HistogramMetricFamily(self.name, self.documentation, labels=labels)
        for values, parts in sorted(counts.items()):
            cumulative, buckets = 0.0, []
            for bound in map(floatToGoString, self.bounds):
                cumulative += parts.get(bound, 0)
                buckets.append((bound, cumulative))
            family.add_metric(list(values), buckets, sum_value=parts.get("sum", 0.0))
        return family


_shared_lock = threading.Lock()
# Family name → field → amount: noted here, not yet in Redis (production), or the store itself
# (embedded mode).
_pending: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(int))
_shared_memory: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(int))


def _note(name: str, field: str, amount: float) -> None:
    with _shared_lock:
        (_pending if settings.REDIS_URL else _shared_memory)[name][field] += amount


def shared_key(name: str) -> str:
    """The Redis hash of the shared family `name`, in the broker's namespace (one installation's
    own, as the tests' stacks are)."""
    namespace = settings.DRAMATIQ_BROKER.get("OPTIONS", {}).get("namespace", "dramatiq")
    return f"{namespace}:metrics:{name}"


def flush_shared(pipe: Any = None) -> None:
    """Write the amounts noted so far to Redis (nothing to do in embedded mode): in one round
    trip, or into `pipe`, a Redis pipeline the caller executes. Counts go as integers, sums as
    floats."""
    with _shared_lock:
        pending = {name: dict(fields) for name, fields in _pending.items()}
        _pending.clear()
    if not pending or not settings.REDIS_URL:
        return
    own = pipe is None
    pipe = redis_client().pipeline(transaction=False) if own else pipe
    for name, fields in pending.items():
        key = shared_key(name)
        for field, amount in fields.items():
            if isinstance(amount, int):
                pipe.hincrby(key, field, amount)
            else:
                pipe.hincrbyfloat(key, field, amount)
    if own:
        pipe.execute()


_flusher: tuple[int, threading.Thread] | None = None


def flush_every(interval_s: float) -> None:
    """Flush this process's noted amounts every `interval_s` from a daemon thread, started by
    the first call in each process. What a process noted in its last interval before it stops
    is lost (a gateway's figures, never a bill)."""
    global _flusher
    with _shared_lock:
        if _flusher is not None and _flusher[0] == os.getpid():
            return
        thread = threading.Thread(
            target=_flush_forever, args=(interval_s,), name="hearth-metrics-flush", daemon=True
        )
        _flusher = (os.getpid(), thread)
    thread.start()


def _flush_forever(interval_s: float) -> None:
    while True:
        time.sleep(interval_s)
        try:
            flush_shared()
        except Exception:  # Redis away: the amounts of that interval are lost, the next go
            logger.warning("metrics not written to Redis", exc_info=True)


class SharedCollector(Collector):
    """Shared families as Prometheus reads them: every family's hash in one Redis round trip
    at each scrape (the process's memory in embedded mode)."""

    def __init__(self, families: list[SharedFamily]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        if settings.REDIS_URL:
            pipe = redis_client().pipeline(transaction=False)
            for family in self.families:
                pipe.hgetall(shared_key(family.name))
            stored = [
                {field.decode(): float(value) for field, value in fields.items()}
                for fields in pipe.execute()
            ]
        else:
            with _shared_lock:
                stored = [dict(_shared_memory[family.name]) for family in self.families]
        for family, fields in zip(self.families, stored, strict=True):
            yield family.metric(fields)


# Hearth's own registry, not prometheus_client's default one: that one also carries this
# process's CPU, memory and garbage-collector figures, which differ per gateway process.
REGISTRY = CollectorRegistry()
REGISTRY.register(RouteCountersCollector())
REGISTRY.register(NodesCollector())
