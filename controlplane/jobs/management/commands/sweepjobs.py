"""`manage.py sweepjobs [--every S] [--grace S]`: the jobs nobody else would move on.

- Queued jobs past their deadline are expired (reads of the jobs API expire an org's own; this
  catches the rest, so `job.expired` events and webhooks go out even when nobody looks).
- Open jobs the broker lost (a Redis restarted without persistence), and open jobs stranded in
  the queue of a node that died, are dispatched again (controlplane/dispatch/redelivery.py), and
  webhook fan-outs and attempts it lost are sent again
  (controlplane/events/redelivery.py).

Run it from cron, or with `--every 10` as a long-running process beside the worker.
"""

from __future__ import annotations

import logging
import time

from django.conf import settings
from django.core.management.base import BaseCommand

from controlplane.dispatch.redelivery import redeliver_lost, reroute_from_dead_nodes
from controlplane.events.redelivery import resend_lost_webhooks
from controlplane.jobs.models import Job

logger = logging.getLogger(__name__)


class Command(BaseCommand):
    help = "Expire queued jobs past their deadline; dispatch again jobs lost with the broker."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--every", type=float, default=0, help="repeat every S seconds")
        parser.add_argument(
            "--grace",
            type=float,
            default=settings.JOB_REDELIVERY_GRACE_S,
            help="a job must be in the broker this long before it can count as lost",
        )

    def handle(self, *args, every: float, grace: float, **options) -> None:
        while True:
            try:
                self.sweep(grace, report=not every)
            except Exception:
                if not every:
                    raise
                # The broker or the database away for a moment: the next round tries again.
                logger.exception("sweep failed")
            if not every:
                return
            time.sleep(every)

    def sweep(self, grace: float, report: bool) -> None:
        expired = Job.objects.expire_overdue()
        redelivered = redeliver_lost(grace)
        rerouted = reroute_from_dead_nodes(grace)
        webhooks = resend_lost_webhooks(grace)
        if expired or redelivered or rerouted or webhooks or report:
            lost = "? (this broker cannot be asked)" if redelivered is None else redelivered
            self.stdout.write(
                f"expired {expired} job(s); dispatched again {lost} job(s) lost with the broker "
                f"and {rerouted} from dead nodes; resent {webhooks} webhook message(s)"
            )
            self.stdout.flush()
