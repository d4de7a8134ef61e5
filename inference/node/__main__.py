"""`python -m inference.node --model ID`: run one node in production mode.

The broker is Redis (`--redis-url`) unless `--broker-url amqp://…` names RabbitMQ; deltas go over
the Channels Redis layer and heartbeats to Redis keys, on `--redis-url`.

`--role prefill` runs a prefill node (inference/disagg/prefill_node.py), `--role decode` a decode
node that has the prompts the gateway split computed by one (docs/disaggregation.md); both move
KV blocks with the Mooncake Transfer Engine on `--kv-host`.

`--metrics-port` serves the node's Prometheus series at `/metrics` on that port
(inference/node/metrics.py); `--log-format` writes its log as JSON lines (the default) or text
(inference/protocol/logs.py).

`--tensor-parallel N` serves the model from a group of N rank processes (`--expert-parallel N`
spreads the experts of a mixture-of-experts model over them); this process is rank 0, the node
the control plane sees (docs/parallelism.md). A rank that dies ends the node with a non-zero exit,
and the broker redelivers what it had not finished. A group may take a disaggregated role: each
rank moves its own share of the KV (docs/disaggregation.md). `--data-parallel-attention` has
each rank run the attention of its own sequences and send tokens to the experts' ranks
(unified role only).

SIGTERM or SIGINT drains the node: it leaves the registry, takes no more work, finishes the
requests it runs, reports them and exits with 0. A second signal stops it at once: the requests
it had not finished stay unacknowledged and the broker redelivers them to another node.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import threading
import uuid

from inference.disagg.layout import kv_layout_of
from inference.disagg.prefill_node import PrefillNode
from inference.disagg.transfer import GroupTransfer
from inference.engine import EngineConfig, LLMEngine
from inference.node import metrics
from inference.node.node import Node
from inference.protocol.delta_publisher import DeltaPublisher
from inference.protocol.heartbeat import RedisHeartbeat
from inference.protocol.logs import FORMATTERS, configure_logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m inference.node")
    parser.add_argument("--model", required=True, help="the served model id (its queue name)")
    parser.add_argument("--source", help="weights: HF directory, .gguf, or default model name")
    parser.add_argument("--node-id", default=f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
    parser.add_argument("--role", default="unified", choices=["unified", "prefill", "decode"])
    parser.add_argument(
        "--kv-host", default="127.0.0.1", help="the address peers reach this node's KV cache on"
    )
    parser.add_argument(
        "--kv-wait-s",
        type=float,
        default=30.0,
        help="decode role: how long a request awaits its KV before it is asked for again",
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--broker-url", help="amqp://… for RabbitMQ; default: --redis-url")
    parser.add_argument("--broker-namespace", default="dramatiq")
    parser.add_argument("--channel-prefix", default="asgi")
    # channels_redis checks capacity on the sender's side, per receiving process: every stream
    # a gateway relays shares one Redis key, so the default 100 drops deltas under load.
    parser.add_argument("--channel-capacity", type=int, default=10_000)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    parser.add_argument(
        "--tensor-parallel", type=int, default=1, help="ranks (processes) serving the model"
    )
    parser.add_argument(
        "--expert-parallel",
        type=int,
        default=1,
        help="1, or --tensor-parallel to spread the experts over the ranks",
    )
    parser.add_argument(
        "--data-parallel-attention",
        action="store_true",
        help="each rank runs the attention of its own sequences; tokens reach the experts "
        "by all-to-all",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant ops: a request's tokens don't depend on its batch "
        "(default: HEARTH_DETERMINISTIC)",
    )
    parser.add_argument(
        "--broker-heartbeat-ms",
        type=int,
        default=60_000,
        help="Redis broker: after this long without a heartbeat a consumer's messages are requeued",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="serve /metrics on this port (0: not at all)"
    )
    parser.add_argument("--metrics-host", default="0.0.0.0", help="the address /metrics binds")
    parser.add_argument(
        "--log-format",
        default="json",
        choices=sorted(FORMATTERS),
        help="json: one object a line with the request's ids; text: for a terminal",
    )
    args = parser.parse_args(argv)
    return args


def make_broker(args: argparse.Namespace):
    url = args.broker_url or args.redis_url
    if url.startswith("amqp"):
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=url)
    from inference.protocol.keyed_messages import KeyedRedisBroker

    return KeyedRedisBroker(
        url=url,
        namespace=args.broker_namespace,
        heartbeat_timeout=args.broker_heartbeat_ms,
        # A dead node's messages are requeued on a fetch of another consumer; on one fetch in
        # ten, not Dramatiq's one in a thousand (it rides along with the fetch).
        maintenance_chance=100_000,
    )


def main(argv: list[str] | None = None) -> int:
    import redis
    from channels_redis.core import RedisChannelLayer

    args = parse_args(argv)
    configure_logging(args.log_format)  # under `manage.py runnode`, Django's LOGGING already is
    node_metrics = metrics.NodeMetrics()
    if args.metrics_port:
        metrics.serve(node_metrics, args.metrics_host, args.metrics_port)
    engine = LLMEngine(
        EngineConfig(
            model=args.source or args.model,
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            kv_cache_memory_bytes=args.kv_cache_mb * 1024 * 1024,
            kv_wait_s=args.kv_wait_s,
            tensor_parallel=args.tensor_parallel,
            expert_parallel=args.expert_parallel,
            data_parallel_attention=args.data_parallel_attention,
            **({"deterministic": True} if args.deterministic else {}),
        )
    )
    broker = make_broker(args)
    publisher = DeltaPublisher(
        RedisChannelLayer(
            hosts=[args.redis_url], prefix=args.channel_prefix, capacity=args.channel_capacity
        )
    )
    heartbeat = RedisHeartbeat(redis.Redis.from_url(args.redis_url))
    transfer = None
    if args.role != "unified" and args.data_parallel_attention:
        engine.close()
        raise SystemExit("--data-parallel-attention serves the unified role only")
    if args.role != "unified":
        # Every rank of a group registers its own cache (inference/disagg/transfer.py).
        transfer = GroupTransfer(engine, kv_layout_of(engine, args.model), host=args.kv_host)
    if args.role == "prefill":
        node = PrefillNode(
            engine, args.model, args.node_id, broker, transfer, heartbeat, metrics=node_metrics
        )
    else:
        node = Node(
            engine,
            args.model,
            args.node_id,
            broker,
            publisher,
            heartbeat,
            args.role,
            transfer,
            metrics=node_metrics,
        )
    stop = threading.Event()

    def drain_then_stop(*_) -> None:
        if node.draining:
            stop.set()
        node.drain()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, drain_then_stop)
    logging.getLogger(__name__).info("%s node %s serving %s", args.role, args.node_id, args.model)
    try:
        node.run(stop)
    finally:
        publisher.close()
        broker.close()
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
