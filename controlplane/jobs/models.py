"""Jobs: every completion request, sync or async, is a Job row with a status machine
queued → running → completed | failed | cancelled | expired.

State changes are conditional UPDATEs or row-locked transactions, so a result delivered twice
(Dramatiq delivers at least once) settles the job and writes its usage row exactly once.
"""

from __future__ import annotations

import logging
import secrets
from decimal import Decimal
from functools import partial
from typing import Any

from django.conf import settings
from django.db import connection, models, transaction
from django.db.models.sql import InsertQuery
from django.utils import timezone

from controlplane import json_rows
from controlplane.accounts.models import Org
from controlplane.billing import budgets
from controlplane.broker import send
from controlplane.events.models import Event

# The app's other models live in their own modules; Django registers them from this one.
from controlplane.jobs.batches import Batch
from controlplane.jobs.files import File  # noqa: F401 (registered here)
from controlplane.jobs.serializers import job_object
from controlplane.joined_rows import instances_from_row
from inference.protocol.messages import ABORT_ACTOR, control_queue

logger = logging.getLogger(__name__)


def new_job_id() -> str:
    return f"job_{secrets.token_hex(12)}"


def new_request_id() -> str:
    return f"req_{secrets.token_hex(12)}"


# What settling a job from its node's result changes (besides `error` or `result`): a full save
# would send the request and its prompt's token ids back to the database with every result.
SETTLED_FIELDS = ["status", "node", "prefill_node", "started_at", "finished_at"]


class JobManager(models.Manager["Job"]):
    def submit_all(self, jobs: list[Job]) -> list[Job]:
        """Insert queued jobs and their `job.queued` events together, in one transaction (the
        caller's, if it holds one): one INSERT of the jobs, sent with the events' statements
        (EventManager.emit_all), so on PostgreSQL the whole is one round trip."""
        if not jobs:
            return jobs
        fields = [f for f in self.model._meta.concrete_fields if not f.generated]
        # Either runs each field's pre_save: `created` is set here, before the events read it.
        if connection.vendor == "postgresql":
            sql, params = json_rows.insert(self.model, fields, jobs)
        else:
            query = InsertQuery(self.model)
            query.insert_values(fields, jobs)
            [(sql, params)] = query.get_compiler(connection=connection).as_sql()
        events = [(job.org, "job.queued", job_object(job)) for job in jobs]
        Event.objects.emit_all(events, first=(sql, list(params)))
        for job in jobs:
            job._state.adding, job._state.db = False, connection.alias
        return jobs

    def record_started(self, payload: dict[str, Any]) -> bool:
        """One start notice (`record_starts`); whether it started the job."""
        return self.record_starts(payload["node"], [payload])[0]

    def record_starts(self, node: str, starts: list[dict[str, Any]]) -> list[bool]:
        """A node took these jobs' requests (a node sends the starts of its report window together):
        queued → running (one event however often), and one more attempt counted; for each,
        whether this notice started it. A job already settled (cancelled or expired while it
        waited, or by another node), or started more than JOB_MAX_ATTEMPTS times (its request
        keeps killing nodes), is stopped on that node instead; past the attempts it is failed.
        A job this node has already finished is left alone: its result overtook this notice."""
        request_ids = [start["request_id"] for start in starts]
        with transaction.atomic():
            claimed = self._claim_queued(request_ids, node)
            if claimed:
                Event.objects.emit_all(
                    [(job.org, "job.running", job_object(job)) for job in claimed.values()]
                )
        # Not queued: a late or repeated notice, a redelivery after a crash. One query for all.
        missed = [request_id for request_id in request_ids if request_id not in claimed]
        found = self.select_related("org").in_bulk(missed, field_name="request_id")
        started = []
        for start in starts:
            job = claimed.get(start["request_id"])
            started.append(job is not None)
            if job is None:
                job = found.get(start["request_id"])
                if job is None:
                    continue
                if job.status in Job.TERMINAL:
                    if not job.finished_by(node, start.get("attempt")):
                        job.abort_on(node)
                    continue
                started[-1] = job.start(node=node, attempt=start.get("attempt"))
            if job.attempts > settings.JOB_MAX_ATTEMPTS:
                job.fail(f"the request was started {job.attempts - 1} times and never finished")
            if job.status in Job.TERMINAL:
                job.abort_on(node)
        return started

    def _claim_queued(self, request_ids: list[str], node: str) -> dict[str, Job]:
        """The common start, queued → running on `node` with one more attempt, for every job
        of `request_ids` that is queued, as one statement that returns them with their orgs
        (what `Job.start` does in a SELECT, an UPDATE and a refresh each), by request id. Empty
        on SQLite, which has no UPDATE in a WITH: there `Job.start` does it."""
        if connection.vendor != "postgresql":
            return {}
        job_fields, org_fields = Job._meta.concrete_fields, Org._meta.concrete_fields
        columns = [f'claimed."{f.column}"' for f in job_fields]
        columns += [f'o."{f.column}"' for f in org_fields]
        with connection.cursor() as cursor:
            cursor.execute(
                f"WITH claimed AS (UPDATE {Job._meta.db_table} SET status = %s, started_at = %s, "
                "node = %s, attempts = attempts + 1 WHERE request_id = ANY(%s) AND status = %s "
                f"RETURNING *) SELECT {', '.join(columns)} FROM claimed "
                f"JOIN {Org._meta.db_table} o ON o.id = claimed.org_id",
                [Job.RUNNING, timezone.now(), node, request_ids, Job.QUEUED],
            )
            rows = cursor.fetchall()
        claimed = {}
        for row in rows:
            job, job.org = instances_from_row(row, [Job, Org])
            claimed[job.request_id] = job
        # The events in the notice's order (RETURNING's order is not the list's).
        return {rid: claimed[rid] for rid in request_ids if rid in claimed}

    def expire_overdue(self, org=None, limit: int = 500) -> int:
        """Queued jobs past their deadline → expired, each once with its event; returns how
        many. Run lazily when jobs are read, and by `manage.py sweepjobs`."""
        now = timezone.now()
        overdue = self.filter(status=Job.QUEUED, deadline_at__lt=now)
        if org is not None:
            overdue = overdue.filter(org=org)
        expired = 0
        for job in overdue.select_related("org").order_by("deadline_at")[:limit]:
            expired += job.expire(now)
        return expired


class Job(models.Model):
    """One completion request and its outcome."""

    QUEUED, RUNNING, COMPLETED, FAILED = "queued", "running", "completed", "failed"
    CANCELLED, EXPIRED = "cancelled", "expired"
    STATUSES = [(s, s) for s in (QUEUED, RUNNING, COMPLETED, FAILED, CANCELLED, EXPIRED)]
    TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED, EXPIRED})
    SYNC, ASYNC, BATCH = "sync", "async", "batch"
    MODES = [(SYNC, SYNC), (ASYNC, ASYNC), (BATCH, BATCH)]
    CHAT, TEXT = "chat.completions", "completions"
    ENDPOINTS = [(CHAT, CHAT), (TEXT, TEXT)]

    id = models.CharField(primary_key=True, max_length=40, default=new_job_id)
    request_id = models.CharField(max_length=40, unique=True, default=new_request_id)
    # Not indexed alone, nor `status` or `created`: the composite indexes below lead with them,
    # and every index is written again at each change of status (a job changes it three times).
    org = models.ForeignKey(
        "accounts.Org", on_delete=models.CASCADE, related_name="jobs", db_index=False
    )
    api_key = models.ForeignKey(
        "accounts.ApiKey", on_delete=models.SET_NULL, null=True, related_name="jobs"
    )
    model = models.CharField(max_length=200)
    mode = models.CharField(max_length=8, choices=MODES, default="sync")
    endpoint = models.CharField(max_length=32, choices=ENDPOINTS, default=CHAT)
    session_affinity = models.CharField(max_length=200, blank=True)
    status = models.CharField(max_length=16, choices=STATUSES, default=QUEUED)
    request = models.JSONField()  # the API request body, as received
    prompt_token_ids = models.JSONField()
    sampling = models.JSONField(default=dict)
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True)
    node = models.CharField(max_length=200, blank=True)
    # The node that computed the prompt when the request was split (its result says; `node`
    # then decoded it); null when `node` computed it too.
    prefill_node = models.CharField(max_length=200, null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    created = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    deadline_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    # Where its generation message was sent, the how-many-th time, and when: the broker holds it
    # under `message_key()` until a node answers it (controlplane/dispatch/redelivery.py).
    queue = models.CharField(max_length=300, blank=True)
    # Why admission chose that queue (dispatch/routing.py): the route counters' key.
    route = models.CharField(max_length=24, blank=True)
    # The prefill queue the message asked its node to send the prompt to, when the gateway split
    # it (dispatch/disaggregation.py); blank: the node prefills it itself.
    prefill_queue = models.CharField(max_length=300, blank=True)
    dispatches = models.PositiveIntegerField(default=1)
    dispatched_at = models.DateTimeField(default=timezone.now)
    # What admission reserved of the month's budgets, and in which scopes (billing/budgets.py);
    # released when the job settles.
    reserved_cost = models.DecimalField(**budgets.MONEY, default=0)
    budget_scopes = models.JSONField(default=list, blank=True)
    # A batch's job: its batch, and the `custom_id` of the input line it answers.
    batch = models.ForeignKey(
        "jobs.Batch", on_delete=models.CASCADE, null=True, blank=True, related_name="jobs"
    )
    custom_id = models.CharField(max_length=512, blank=True)
    # Written when it settles, for the dashboard's percentiles (console/dashboard.py): the node's
    # timings (inference/engine/outputs.py Timings; null where it sent none), the seconds from
    # admission to its start, and the code of a failure (the node's, or `expired`).
    ttft_s = models.FloatField(null=True, blank=True)
    tpot_s = models.FloatField(null=True, blank=True)
    e2e_s = models.FloatField(null=True, blank=True)
    queue_wait_s = models.FloatField(null=True, blank=True)
    error_code = models.CharField(max_length=64, blank=True)

    objects = JobManager()

    class Meta:
        indexes = [
            # The jobs list (an org's newest first) and its cursor.
            models.Index(fields=["org", "-created", "-id"], name="job_org_created"),
            # Queue positions and the expiry sweep.
            models.Index(fields=["status", "model", "created"], name="job_status_model_created"),
            # The dashboard's latency percentiles of the jobs an org settled in the last 30 days
            # (console/dashboard_figures.py), read from the index alone: a month of job rows is
            # hundreds of MB to scan (bench/console.py). Settled jobs only, so a job adds its entry
            # once, when it settles.
            models.Index(
                fields=["org", "finished_at"],
                include=["ttft_s", "tpot_s", "queue_wait_s"],
                condition=models.Q(finished_at__isnull=False),
                name="job_org_finished",
            ),
        ]

    def start(self, node: str = "", attempt: int | None = None) -> bool:
        """queued → running, once (True then); a later start of a running job (its message
        redelivered after its node died) counts one more attempt and moves it to that node. A
        second notice of the start already counted (same node, an `attempt` number already
        reached: the gateway records a start it saw in a stream before the node's own notice
        arrives) changes nothing."""
        now = timezone.now()
        with transaction.atomic():
            claimed = Job.objects.filter(pk=self.pk, status=Job.QUEUED).update(
                status=Job.RUNNING,
                started_at=now,
                node=node,
                attempts=models.F("attempts") + 1,
            )
            if not claimed:
                # A redelivery: the node that ran it died (or restarted) before it finished.
                rerun = Job.objects.filter(pk=self.pk, status=Job.RUNNING)
                if attempt is not None:
                    rerun = rerun.exclude(node=node, attempts__gte=attempt)
                rerun.update(node=node, attempts=models.F("attempts") + 1)
            self.refresh_from_db(fields=["status", "started_at", "node", "attempts"])
            if claimed:
                self.emit("job.running")
        return bool(claimed)

    def cancel(self) -> bool:
        """Cancel: a queued job is cancelled now; a running one is stopped on its node and
        settles as cancelled, billed for what it generated, when the node reports it. False when
        the job is already settled (or its cancel already asked)."""
        now = timezone.now()
        with transaction.atomic():
            cancelled = Job.objects.filter(pk=self.pk, status=Job.QUEUED).update(
                status=Job.CANCELLED, finished_at=now, cancel_requested_at=now
            )
            if cancelled:
                self.refresh_from_db()
                budgets.settle(self, Decimal(0))
                self.emit("job.cancelled")
                return True
            requested = Job.objects.filter(
                pk=self.pk, status=Job.RUNNING, cancel_requested_at__isnull=True
            ).update(cancel_requested_at=now)
        self.refresh_from_db()
        if requested:
            self.abort_on(self.node)
        return bool(requested)

    def expire(self, now=None) -> bool:
        """queued → expired (its deadline passed before any node took it), once."""
        now = now or timezone.now()
        with transaction.atomic():
            expired = Job.objects.filter(pk=self.pk, status=Job.QUEUED).update(
                status=Job.EXPIRED,
                finished_at=now,
                error="the job's deadline passed before it started",
                error_code="expired",
            )
            if expired:
                self.refresh_from_db()
                budgets.settle(self, Decimal(0))
                self.emit("job.expired")
        return bool(expired)

    def finished_by(self, node: str, attempt: int | None) -> bool:
        """Whether this settled job's result came from `node`'s run number `attempt` (or one
        after it): a start notice for that run arriving now is late, not a new run to stop.
        The worker handles a node's start and result messages in parallel, so a short job's
        result is often settled first (`_settlement` takes it through running)."""
        return bool(node) and self.node == node and (attempt or 1) <= self.attempts

    def abort_on(self, node: str) -> None:
        """Ask `node` to stop this job's request (its control queue); best effort: a node that
        no longer runs it drops the message."""
        if not node:
            return
        abort = {"request_id": self.request_id}
        transaction.on_commit(partial(send, control_queue(self.model, node), ABORT_ACTOR, abort))

    def fail(self, error: str, code: str = "undeliverable") -> bool:
        """→ failed from queued or running, once (a job the control plane cannot hand on)."""
        now = timezone.now()
        with transaction.atomic():
            failed = Job.objects.filter(pk=self.pk, status__in=[Job.QUEUED, Job.RUNNING]).update(
                status=Job.FAILED, error=error, error_code=code, finished_at=now
            )
            if failed:
                self.status, self.error, self.finished_at = Job.FAILED, error, now
                self.error_code = code
                budgets.settle(self, Decimal(0))
                self.emit("job.failed")
        return bool(failed)

    def emit(self, type: str) -> Event:
        """Record a state change of this job in the org's event log (and push it).

        Every terminal transition emits exactly once, in its own transaction, so this is where a
        batch counts its settled jobs. The count comes after the event: every settling
        transaction then takes the org's event lock before the batch row, never the reverse,
        so two of them cannot deadlock."""
        event = Event.objects.emit(self.org, type, job_object(self))
        if self.batch_id is not None and self.status in Job.TERMINAL:
            Batch.objects.job_settled(self)
        return event

    @staticmethod
    def discount_percent(price, mode: str) -> int:
        """The price's async discount, for the work that can wait (async jobs, batch lines)."""
        return price.async_discount_percent if mode in (Job.ASYNC, Job.BATCH) else 0

    def message_key(self) -> str:
        """Its current generation message's key in the broker (protocol.keyed_messages)."""
        return f"{self.request_id}.{self.dispatches}"

    def generation_message(
        self, reply_channel: str | None = None, deadline: float | None = None
    ) -> dict[str, Any]:
        """The broker message body a node serves this job from (inference.protocol.messages);
        `deadline` is epoch seconds after which the engine stops it. A split job's names its
        prefill queue (`prefill`); an unsplit one's has no such key."""
        message = {
            "request_id": self.request_id,
            "job_id": self.id,
            "org": self.org.slug,
            "prompt_token_ids": self.prompt_token_ids,
            "sampling": self.sampling,
            "reply_channel": reply_channel,
            "deadline": deadline,
            "attempt": self.attempts + 1,
        }
        if self.prefill_queue:
            message["prefill"] = {"queue": self.prefill_queue}
        return message
