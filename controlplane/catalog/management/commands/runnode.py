"""`manage.py runnode --model ID [--role unified|prefill|decode]`: run a node for a catalog model
(a thin wrapper).

The node itself (`inference.node`) needs no Django; this command only looks the model's weights
up in the catalog and passes the broker and Redis settings on, and the node's role: `unified`
(prefill and decode), or one side of disaggregated serving (controlplane/catalog/registry.py).
`--metrics-port` (default HEARTH_NODE_METRICS_PORT; unset or 0: none) serves the node's own
`/metrics` (inference/node/metrics.py); its log follows the settings' LOGGING (HEARTH_LOG_FORMAT).
`--deterministic` runs the engine batch-invariant (docs/determinism.md).
`--tensor-parallel N --expert-parallel M [--data-parallel-attention]` serve the model from a
group of N rank processes, one node to the control plane (docs/parallelism.md).
"""

import os
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from controlplane.catalog.models import ServedModel
from controlplane.catalog.registry import NODE_ROLES, UNIFIED
from inference.node.__main__ import main as node_main


class Command(BaseCommand):
    help = "Run an inference node serving a catalog model."

    def add_arguments(self, parser):
        parser.add_argument("--model", required=True)
        parser.add_argument("--node-id")
        parser.add_argument("--role", default=UNIFIED, choices=NODE_ROLES)
        parser.add_argument("--dtype", default="auto")
        parser.add_argument("--max-num-seqs", type=int, default=64)
        parser.add_argument("--kv-cache-mb", type=int, default=512)
        parser.add_argument("--kv-host", default="127.0.0.1")
        parser.add_argument("--kv-wait-s", type=float, default=30.0)
        parser.add_argument("--tensor-parallel", type=int, default=1)
        parser.add_argument("--expert-parallel", type=int, default=1)
        parser.add_argument("--data-parallel-attention", action="store_true")
        parser.add_argument("--deterministic", action="store_true")
        parser.add_argument(
            "--metrics-port", type=int, default=int(os.environ.get("HEARTH_NODE_METRICS_PORT") or 0)
        )

    def handle(self, *args, **options):
        model = ServedModel.objects.filter(id=options["model"], enabled=True).first()
        if model is None:
            raise CommandError(f"no enabled model {options['model']!r} in the catalog")
        if not settings.REDIS_URL:
            raise CommandError("runnode needs REDIS_URL (embedded mode runs its node in-process)")
        argv = node_argv(model, options)
        # The node never touches the database: it holds no connection while it serves.
        connections.close_all()
        raise SystemExit(node_main(argv))


def node_argv(model: ServedModel, options: dict[str, Any]) -> list[str]:
    """`python -m inference.node`'s arguments for `model`, from this command's `options` and
    the control plane's settings."""
    argv = [
        "--model",
        model.id,
        "--source",
        model.source,
        "--redis-url",
        settings.REDIS_URL,
        "--broker-url",
        settings.BROKER_URL,
        "--broker-namespace",
        settings.DRAMATIQ_BROKER.get("OPTIONS", {}).get("namespace", "dramatiq"),
        "--channel-prefix",
        settings.CHANNEL_PREFIX,
        "--dtype",
        options["dtype"],
        "--max-num-seqs",
        str(options["max_num_seqs"]),
        "--kv-cache-mb",
        str(options["kv_cache_mb"]),
        "--broker-heartbeat-ms",
        str(settings.BROKER_HEARTBEAT_TIMEOUT_MS),
        "--role",
        options["role"],
        "--kv-host",
        options.get("kv_host") or "127.0.0.1",
        "--kv-wait-s",
        str(options.get("kv_wait_s") or 30.0),
        "--tensor-parallel",
        str(options.get("tensor_parallel") or 1),
        "--expert-parallel",
        str(options.get("expert_parallel") or 1),
    ]
    if options.get("data_parallel_attention"):
        argv.append("--data-parallel-attention")
    if options.get("deterministic"):
        argv.append("--deterministic")
    if options["node_id"]:
        argv += ["--node-id", options["node_id"]]
    if options.get("metrics_port"):
        argv += ["--metrics-port", str(options["metrics_port"])]
    return argv
