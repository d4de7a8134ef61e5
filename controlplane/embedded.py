"""Embedded mode: Hearth in one process, with no other services (docs/architecture.md).

The gateway (uvicorn), a Dramatiq worker for the control plane's own queue on the StubBroker, the
in-memory channel layer, SQLite, and one node per enabled catalog model, each in a thread of its
own. The code paths are the production ones; only the backends differ. The in-memory layer's
queues belong to the server's event loop, so the nodes' delta sends and the event pushes are run
on that loop (DeltaPublisher(loop=…), events.push.bind_loop).

With `disaggregated`, each model gets a prefill node and a decode node instead of one unified
node, which move KV blocks over the Mooncake Transfer Engine on loopback
(docs/disaggregation.md): the split with no other service.

The one `GET /metrics` shows every part: the worker's series (jobs/job_metrics.py) and the
nodes' (inference/node/metrics.py) are registered in the gateway's registry while it serves.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import dramatiq
import uvicorn
from channels.layers import get_channel_layer
from django.conf import settings

from controlplane.catalog.models import ServedModel
from controlplane.catalog.registry import use_memory_heartbeat
from controlplane.dispatch.redelivery import redispatch_open
from controlplane.events.push import bind_loop
from controlplane.jobs import job_metrics
from controlplane.metrics import REGISTRY
from inference.disagg.layout import kv_layout_of
from inference.disagg.prefill_node import PrefillNode
from inference.disagg.transfer import KVTransfer
from inference.engine import EngineConfig, LLMEngine
from inference.node.metrics import NodeMetrics
from inference.node.node import Node
from inference.protocol.delta_publisher import DeltaPublisher
from inference.protocol.heartbeat import MemoryHeartbeat
from inference.protocol.messages import CONTROLPLANE_QUEUE

logger = logging.getLogger(__name__)


class EmbeddedHearth:
    """Runs everything until `serve()` returns (SIGINT/SIGTERM stop uvicorn, then the rest)."""

    def __init__(
        self,
        host: str,
        port: int,
        dtype: str = "auto",
        kv_cache_mb: int = 256,
        disaggregated: bool = False,
        deterministic: bool = False,
    ):
        if not settings.EMBEDDED:
            raise RuntimeError("embedded mode runs without REDIS_URL")
        self.host, self.port = host, port
        self.dtype, self.kv_cache_mb = dtype, kv_cache_mb
        self.disaggregated = disaggregated
        # True: deterministic engines; False leaves EngineConfig's default (HEARTH_DETERMINISTIC).
        self.deterministic = deterministic
        self.stop = threading.Event()
        self.heartbeat = MemoryHeartbeat()
        self.node_metrics = NodeMetrics()  # every node's of this process
        self.threads: list[threading.Thread] = []

    def _start_worker(self) -> dramatiq.Worker:
        import controlplane.jobs.tasks  # noqa: F401  (registers the control plane's actors)

        broker = dramatiq.get_broker()
        broker.declare_queue(CONTROLPLANE_QUEUE)
        # Only the control plane's queue: the nodes' queues are declared on the same broker.
        worker = dramatiq.Worker(broker, queues={CONTROLPLANE_QUEUE}, worker_threads=2)
        worker.start()
        return worker

    def _start_nodes(self, loop: asyncio.AbstractEventLoop) -> None:
        broker = dramatiq.get_broker()
        for model in ServedModel.objects.filter(enabled=True).order_by("id"):
            logger.info("loading %s", model.id)
            publisher = DeltaPublisher(get_channel_layer(), loop=loop)
            name = f"embedded-{model.id}"
            if not self.disaggregated:
                node = Node(
                    self._engine(model),
                    model.id,
                    name,
                    broker,
                    publisher,
                    self.heartbeat,
                    metrics=self.node_metrics,
                )
                self._run(node, f"node-{model.id}")
                continue
            prefill_engine, decode_engine = self._engine(model), self._engine(model)
            prefill = PrefillNode(
                prefill_engine,
                model.id,
                f"{name}-prefill",
                broker,
                self._transfer(prefill_engine, model.id),
                self.heartbeat,
                metrics=self.node_metrics,
            )
            decode = Node(
                decode_engine,
                model.id,
                f"{name}-decode",
                broker,
                publisher,
                self.heartbeat,
                role="decode",
                kv=self._transfer(decode_engine, model.id),
                metrics=self.node_metrics,
            )
            self._run(prefill, f"prefill-{model.id}")
            self._run(decode, f"decode-{model.id}")

    def _engine(self, model: ServedModel) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=model.source,
                dtype=self.dtype,
                kv_cache_memory_bytes=self.kv_cache_mb * 1024 * 1024,
                max_model_len=model.context_length,
                **({"deterministic": True} if self.deterministic else {}),
            )
        )

    def _transfer(self, engine: LLMEngine, model_id: str) -> KVTransfer:
        """The engine's KV cache registered with a Transfer Engine on loopback."""
        return KVTransfer(engine.runner.kv_buffer, kv_layout_of(engine, model_id))

    def expose_metrics(self) -> None:
        """Register the worker's and the nodes' series in the gateway's registry: this process's
        `GET /metrics` shows them (`hide_metrics` undoes it)."""
        for collector in [*job_metrics.COLLECTORS, self.node_metrics]:
            REGISTRY.register(collector)

    def hide_metrics(self) -> None:
        for collector in [*job_metrics.COLLECTORS, self.node_metrics]:
            REGISTRY.unregister(collector)

    def _run(self, node, name: str) -> None:
        thread = threading.Thread(target=node.run, args=(self.stop,), name=name, daemon=True)
        thread.start()
        self.threads.append(thread)

    async def serve(self) -> None:
        from controlplane.asgi import application

        loop = asyncio.get_running_loop()
        bind_loop(loop)
        use_memory_heartbeat(self.heartbeat)
        self.expose_metrics()
        worker = self._start_worker()
        try:
            # Engines load before the port opens: /healthz answering means nodes are serving.
            await asyncio.to_thread(self._start_nodes, loop)
            # The in-process broker kept nothing from the last run: its open jobs go out again.
            redispatched = await asyncio.to_thread(redispatch_open)
            if redispatched:
                print(f"Resumed {redispatched} job(s) left open by the last run", flush=True)
            config = uvicorn.Config(
                application, host=self.host, port=self.port, lifespan="off", log_level="warning"
            )
            server = uvicorn.Server(config)
            print(f"Hearth is running at http://{self.host}:{self.port}/console/", flush=True)
            await server.serve()
        finally:
            self.stop.set()
            for thread in self.threads:
                await asyncio.to_thread(thread.join, 10)
            worker.stop()
            self.hide_metrics()
            bind_loop(None)
            use_memory_heartbeat(None)
