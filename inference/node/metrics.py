"""A node's Prometheus series, as the node itself measures them, labelled by model and node.

- `hearth_node_step_seconds`, `hearth_node_batch_size` (sequences) and `hearth_node_batch_tokens`:
  histograms of every engine step that ran a batch.
- `hearth_node_ttft_seconds`, `hearth_node_tpot_seconds`: histograms of each finished request's
  time to first token and time per output token after it, on the engine's clock (a request's
  first choice, as its result reports them).
- `hearth_node_kv_blocks_used`, `hearth_node_kv_blocks_free`, `hearth_node_running_requests`,
  `hearth_node_waiting_requests` (gauges) and `hearth_node_prefix_cache_query_tokens_total`,
  `hearth_node_prefix_cache_hit_tokens_total` (counters, since the engine started): the engine's
  figures when the node last built its heartbeat (every 2 s), so they equal what the heartbeat
  in the registry says. Read between steps, on the node's own thread: a scrape never reads the
  engine while it steps.

A node process serves them on `--metrics-port` (`serve`, prometheus_client's own HTTP server: the
node has no Django). In embedded mode the nodes run inside the gateway's process and the one
`NodeMetrics` of that process is registered in the gateway's registry (controlplane/embedded.py):
`GET /metrics` shows them beside the control plane's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inference.engine.llm_engine import LLMEngine
from inference.engine.outputs import EngineStats, RequestOutput, Timings
from inference.protocol import buckets

LABELS = ("model", "node")
# (series, help, what it reads from EngineStats) of the figures kept from the last heartbeat.
GAUGES = (
    ("hearth_node_kv_blocks_used", "KV blocks in use.", lambda s: s.num_blocks - s.num_free_blocks),
    ("hearth_node_kv_blocks_free", "KV blocks free.", lambda s: s.num_free_blocks),
    ("hearth_node_running_requests", "Sequences the engine runs.", lambda s: s.num_running),
    ("hearth_node_waiting_requests", "Sequences waiting to start.", lambda s: s.num_waiting),
)
COUNTERS = (
    (
        "hearth_node_prefix_cache_query_tokens_total",
        "Prompt tokens looked up in the prefix cache, since the engine started.",
        lambda s: s.prefix_cache_query_tokens,
    ),
    (
        "hearth_node_prefix_cache_hit_tokens_total",
        "Prompt tokens the prefix cache served, since the engine started.",
        lambda s: s.prefix_cache_hit_tokens,
    ),
)


class NodeMetrics(Collector):
    """The series of every node in this process (one in a node process, one per model in
    embedded mode); `node()` gives each node its recorder."""

    def __init__(self) -> None:
        def histogram(name: str, help_text: str, bounds: tuple[float, ...]) -> Histogram:
            # In no registry of its own: this collector yields it.
            return Histogram(name, help_text, LABELS, buckets=bounds, registry=None)

        self.step_seconds = histogram(
            "hearth_node_step_seconds", "Engine steps that ran a batch.", buckets.STEP_SECONDS
        )
        self.batch_size = histogram(
            "hearth_node_batch_size", "Sequences in each step's batch.", buckets.BATCH_SEQUENCES
        )
        self.batch_tokens = histogram(
            "hearth_node_batch_tokens", "Tokens each step computed.", buckets.BATCH_TOKENS
        )
        self.ttft_seconds = histogram(
            "hearth_node_ttft_seconds",
            "Finished requests' time to first token on the node, from its arrival at the engine.",
            buckets.TTFT_SECONDS,
        )
        self.tpot_seconds = histogram(
            "hearth_node_tpot_seconds",
            "Finished requests' time per output token after the first, on the node.",
            buckets.TPOT_SECONDS,
        )
        self._lock = threading.Lock()
        self._engine_stats: dict[tuple[str, str], EngineStats] = {}

    def node(self, model: str, node_id: str) -> NodeRecorder:
        return NodeRecorder(self, (model, node_id))

    def keep_engine_stats(self, labels: tuple[str, str], stats: EngineStats) -> None:
        """Keep `stats` as the node's figures until its next heartbeat."""
        with self._lock:
            self._engine_stats[labels] = stats

    def collect(self) -> Iterator[Metric]:
        for histogram in (
            self.step_seconds,
            self.batch_size,
            self.batch_tokens,
            self.ttft_seconds,
            self.tpot_seconds,
        ):
            yield from histogram.collect()
        with self._lock:
            kept = sorted(self._engine_stats.items())
        for family_type, series in ((GaugeMetricFamily, GAUGES), (CounterMetricFamily, COUNTERS)):
            for name, help_text, read in series:
                family = family_type(name, help_text, labels=LABELS)
                for labels, stats in kept:
                    family.add_metric(labels, read(stats))
                yield family


class NodeRecorder:
    """What one node records, called from its loop (inference/node/node.py)."""

    def __init__(self, metrics: NodeMetrics, labels: tuple[str, str]) -> None:
        self.metrics = metrics
        self.labels = labels
        self._step = metrics.step_seconds.labels(*labels)
        self._batch_size = metrics.batch_size.labels(*labels)
        self._batch_tokens = metrics.batch_tokens.labels(*labels)
        self._ttft = metrics.ttft_seconds.labels(*labels)
        self._tpot = metrics.tpot_seconds.labels(*labels)

    def timed_step(self, engine: LLMEngine) -> list[RequestOutput]:
        """`engine.step()`, timed; a step that ran no batch (only finished requests to report)
        is not a step of the histograms."""
        started = time.perf_counter()
        outputs = engine.step()
        if engine.last_step_sequences:
            self._step.observe(time.perf_counter() - started)
            self._batch_size.observe(engine.last_step_sequences)
            self._batch_tokens.observe(engine.last_step_tokens)
        return outputs

    def finished(self, timings: Timings) -> None:
        """A request finished: its TTFT and TPOT, those it has (one that generated nothing has
        no TTFT, one that generated one token no TPOT)."""
        if timings.ttft_s is not None:
            self._ttft.observe(timings.ttft_s)
        if timings.tpot_s is not None:
            self._tpot.observe(timings.tpot_s)

    def engine_stats(self, stats: EngineStats) -> None:
        """The engine's figures as the heartbeat being built reports them."""
        self.metrics.keep_engine_stats(self.labels, stats)


def serve(metrics: NodeMetrics, host: str, port: int) -> None:
    """Serve `metrics` at http://host:port/metrics from a daemon thread (prometheus_client's
    server; a port in use raises OSError, and the node does not start)."""
    registry = CollectorRegistry()
    registry.register(metrics)
    start_http_server(port, addr=host, registry=registry)
