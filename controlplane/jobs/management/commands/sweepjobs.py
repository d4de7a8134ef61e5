"""`manage.py sweepjobs [--every S]`: expire queued jobs past their deadline (every org's).

Reads of the jobs API expire an org's overdue jobs on their own; this catches the rest, so
`job.expired` events and webhooks go out even when nobody looks. Run it from cron, or with
`--every 30` as a long-running process beside the worker.
"""

from __future__ import annotations

import time

from django.core.management.base import BaseCommand

from controlplane.jobs.models import Job


class Command(BaseCommand):
    help = "Expire queued jobs whose deadline has passed."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--every", type=float, default=0, help="repeat every S seconds")

    def handle(self, *args, every: float, **options) -> None:
        while True:
            expired = Job.objects.expire_overdue()
            if expired or not every:
                self.stdout.write(f"expired {expired} job(s)")
            if not every:
                return
            time.sleep(every)
