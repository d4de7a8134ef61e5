"""Settlement: a node's results (`CompletionResult`, the wire protocol's) settle their jobs and
bill them, exactly once however often a result is delivered. The worker's `record_completion`
actor and the tests call `record_completions`; it decides each outcome (`_settlement`), reads the
jobs under their row locks and writes every outcome at once.

Every job is settled once by the worker, so this is the control plane's busiest transaction
after admission. A node sends the results it finished within its report window together, and
they settle in one transaction. On PostgreSQL it is three round trips however many jobs it
settles: a SELECT … FOR UPDATE that returns the jobs with their orgs and the prices in effect
when they were admitted; one query that carries the usage rows' INSERT, the jobs' UPDATE, the
budgets' settlement, the orgs' event locks and the events' INSERT (EventManager.emit_all); the
COMMIT.
The rows of each INSERT and UPDATE travel as one JSON document (json_rows.py).
They are written out rather than built by the ORM: compiling a
`select_for_update().select_related()`, a price query and three saves cost the worker more CPU
than PostgreSQL took to run them (docs/performance.md). SQLite (embedded mode) goes through the
ORM, a statement at a time.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from controlplane import json_rows
from controlplane.accounts.models import Org
from controlplane.billing import budgets
from controlplane.billing.models import UsageRecord
from controlplane.catalog.models import Price, price_in_effect
from controlplane.events.models import Event
from controlplane.jobs.batches import Batch
from controlplane.jobs.job_metrics import count_on_commit
from controlplane.jobs.models import SETTLED_FIELDS, Job
from controlplane.jobs.serializers import job_object
from controlplane.joined_rows import instances_from_row
from inference.protocol.messages import CompletionResult

logger = logging.getLogger(__name__)


def record_completion(result: CompletionResult) -> bool:
    """Settle the job of one node result (`record_completions`); False if it was already
    settled (a redelivery) or is unknown."""
    return record_completions([result])[0]


def record_completions(results: list[CompletionResult]) -> list[bool]:
    """Settle the jobs of node results (a node sends those it finished within its report
    window together) and bill them; for each, whether it settled its job (False: already settled,
    a redelivery, or unknown). One transaction for all of them. If it fails (a deadlock's
    victim, a result that cannot be recorded), each goes in a transaction of its own, so
    one bad result holds up none of the others; the first error is raised after them, for
    Dramatiq to deliver the message again (what settled then settles nothing)."""
    if len(results) > 1:
        try:
            with transaction.atomic():
                return _settle(results)
        except Exception:
            logger.warning("settling %d results together failed", len(results), exc_info=True)
    settled, failure = [], None
    for result in results:
        try:
            with transaction.atomic():
                settled += _settle([result])
        except Exception as error:
            failure = failure or error
            settled.append(False)
    if failure is not None:
        raise failure
    return settled


def _settle(results: list[CompletionResult]) -> list[bool]:
    """`record_completions` inside the caller's transaction: the jobs under their row locks
    (serialising concurrent deliveries of one result), then every write at once."""
    locked = lock_for_settling([result.request_id for result in results])
    now = timezone.now()
    settled, settlements = [], []
    for result in results:
        loaded = locked.get(result.request_id)
        if loaded is None:
            logger.warning("record_completion for unknown request %s", result.request_id)
        job = None if loaded is None else loaded[0]
        # Terminal: settled before, or earlier in this same list (a result twice).
        settled.append(job is not None and job.status not in Job.TERMINAL)
        if settled[-1]:
            settlements.append(_settlement(job, loaded[1], result, now))
    write_settlements(settlements)
    for settlement in settlements:
        if settlement.job.batch_id is not None:
            Batch.objects.job_settled(settlement.job)  # after the events: see Job.emit
    count_on_commit(settlements)  # metrics and the log line of each (jobs/job_metrics.py)
    return settled


@dataclass
class Settlement:
    """What settling one job writes: the job as settled, its usage row (None: nothing billed),
    the cost the budgets settle, and its events (type, data)."""

    job: Job
    record: UsageRecord | None
    cost: Decimal
    events: list[tuple[str, dict[str, Any]]]


def _settlement(job: Job, price, result: CompletionResult, now) -> Settlement:
    """Decide how a node's result settles `job` (open, locked) at `price`; changes `job`."""
    events = []
    job.node, job.prefill_node = result.node, result.prefill_node
    if result.error is None and job.status == Job.QUEUED:
        # The worker took the result before the node's `record_started` notice (they are
        # separate messages): the job did run, so it passes through running here, and the late
        # notice finds it no longer queued.
        job.status, job.started_at = Job.RUNNING, now
        job.attempts += 1
        events.append(("job.running", job_object(job)))
    job.finished_at = now
    job.started_at = job.started_at or now
    job.queue_wait_s = max((job.started_at - job.created).total_seconds(), 0.0)
    job.ttft_s, job.tpot_s, job.e2e_s = (
        _seconds(result.timings.get(name)) for name in ("ttft_s", "tpot_s", "e2e_s")
    )
    record, cost = None, Decimal(0)
    if result.error:
        job.status = Job.EXPIRED if result.error_code == "expired" else Job.FAILED
        job.error = result.error
        job.error_code = (result.error_code or "node_error")[:64]
    else:
        usage = result.usage
        record = UsageRecord.objects.build(
            request_id=job.request_id,
            org_id=job.org_id,
            api_key_id=job.api_key_id,
            model=job.model,
            mode=job.mode,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
            price=price,
            discount_percent=Job.discount_percent(price, job.mode),
        )
        cost = record.total_cost
        # Stopped early on purpose: billed for what it generated, settled as what stopped it.
        job.status = Job.COMPLETED
        if result.finish_reason == "deadline":
            job.status = Job.EXPIRED
        elif result.finish_reason == "abort" and job.cancel_requested_at is not None:
            job.status = Job.CANCELLED
        job.result = {
            "text": result.text,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "usage": dataclasses.asdict(usage),
            "cost": record.cost_object(),
            "timings": result.timings,
            "logprobs": result.logprobs,
            "choices": result.choices,
            "system_fingerprint": result.system_fingerprint,
        }
    events.append((f"job.{job.status}", job_object(job)))
    return Settlement(job, record, cost, events)


def _seconds(value: Any) -> float | None:
    """A node's timing as a number of seconds; None for one it did not send (or not a number)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


# What settling writes to the job row, besides SETTLED_FIELDS.
WRITTEN_FIELDS = [
    *SETTLED_FIELDS,
    *("attempts", "error", "result", "error_code"),
    *("ttft_s", "tpot_s", "e2e_s", "queue_wait_s"),
]


def lock_for_settling(request_ids: list[str]) -> dict[str, tuple[Job, Price | None]]:
    """The jobs of `request_ids` under their row locks (serialising concurrent deliveries of a
    result), each with its org and the price in effect when it was admitted, by request id; an
    unknown one is absent. Locked in request id order, so two transactions settling overlapping
    results cannot deadlock on each other's rows."""
    if connection.vendor != "postgresql":
        locked = {}
        for request_id in sorted(set(request_ids)):
            job = Job.objects.select_for_update().select_related("org")
            job = job.filter(request_id=request_id).first()
            if job is not None:
                locked[request_id] = (job, price_in_effect(job.model, job.created))
        return locked
    parts = [(Job, "j"), (Org, "o"), (Price, "p")]
    columns = [f'{a}."{f.column}"' for model, a in parts for f in model._meta.concrete_fields]
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {', '.join(columns)} FROM {Job._meta.db_table} j "
            f"JOIN {Org._meta.db_table} o ON o.id = j.org_id "
            f"LEFT JOIN LATERAL (SELECT * FROM {Price._meta.db_table} "
            "WHERE model_id = j.model AND effective_from <= j.created "
            "ORDER BY effective_from DESC LIMIT 1) p ON true "
            "WHERE j.request_id = ANY(%s) ORDER BY j.request_id FOR UPDATE OF j",
            [list(request_ids)],
        )
        rows = cursor.fetchall()
    locked = {}
    for row in rows:
        job, job.org, price = instances_from_row(row, [Job, Org, Price])  # price None: none found
        locked[job.request_id] = (job, price)
    return locked


def write_settlements(settlements: list[Settlement]) -> None:
    """Write each settled job, its usage row, the budgets' settlement of its cost and its
    events, inside the caller's transaction: on PostgreSQL one query for all of them."""
    if not settlements:
        return
    if connection.vendor != "postgresql":
        for s in settlements:
            if s.record is not None:
                s.record.save(force_insert=True)
            s.job.save(update_fields=WRITTEN_FIELDS)
            budgets.settle(s.job, s.cost)
        Event.objects.emit_all([(s.job.org, t, data) for s in settlements for t, data in s.events])
        return
    records = [s.record for s in settlements if s.record is not None]
    statements = [_insert(records)] if records else []
    job_fields = [Job._meta.get_field(name) for name in WRITTEN_FIELDS]
    statements.append(json_rows.update(Job, job_fields, [s.job for s in settlements]))
    statements += budgets.settle_statements([(s.job, s.cost) for s in settlements])
    sql = ";\n".join(statement for statement, _ in statements)
    params = [value for _, values in statements for value in values]
    events = [(s.job.org, type, data) for s in settlements for type, data in s.events]
    Event.objects.emit_all(events, first=(sql, params))
    for record in records:
        record._state.adding, record._state.db = False, connection.alias


def _insert(rows: list) -> tuple[str, list[Any]]:
    """The INSERT of unsaved rows of one model whose primary keys the database assigns (no
    RETURNING)."""
    meta = rows[0]._meta
    fields = [f for f in meta.concrete_fields if not f.generated and f is not meta.auto_field]
    return json_rows.insert(type(rows[0]), fields, rows)
