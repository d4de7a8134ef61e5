"""`manage.py serve`: run Hearth in embedded mode (one process; what `make run` starts).

In production run the parts separately: `uvicorn controlplane.asgi:application`,
`manage.py runnode --model ID`, `manage.py rundramatiq --queues default`."""

import asyncio

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from controlplane.embedded import EmbeddedHearth


class Command(BaseCommand):
    help = "Run Hearth in embedded mode: gateway, worker and nodes in one process."

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--dtype", default="auto")
        parser.add_argument("--kv-cache-mb", type=int, default=256)
        parser.add_argument(
            "--disaggregated",
            action="store_true",
            help="a prefill node and a decode node per model, KV moved over loopback",
        )
        parser.add_argument(
            "--deterministic",
            action="store_true",
            help="batch-invariant engines: the same request, the same tokens (docs/determinism.md)",
        )

    def handle(self, *args, host: str, port: int, dtype: str, kv_cache_mb: int, **options):
        if not settings.EMBEDDED:
            raise CommandError(
                "serve is embedded mode; with REDIS_URL set run uvicorn, runnode and rundramatiq"
            )
        hearth = EmbeddedHearth(
            host, port, dtype, kv_cache_mb, options["disaggregated"], options["deterministic"]
        )
        asyncio.run(hearth.serve())
