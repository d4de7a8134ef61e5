"""The reads and writes of settling jobs from their nodes' results
(`JobManager.record_completions` decides; this reads the jobs and writes the outcomes).

Every job is settled once by the worker, so this is the control plane's busiest transaction
after admission. A node sends the results one engine step finished together, and they settle in
one transaction. On PostgreSQL it is three round trips however many jobs it settles: a SELECT …
FOR UPDATE that returns the jobs with their orgs and the prices in effect when they were
admitted; one query that carries the usage rows' INSERT, the jobs' UPDATE, the budgets'
settlement, the orgs' event locks and the events' INSERT (EventManager.emit_all); the COMMIT.
The rows of each INSERT and UPDATE travel as one JSON document (json_rows.py).
They are written out rather than built by the ORM: compiling a
`select_for_update().select_related()`, a price query and three saves cost the worker more CPU
than PostgreSQL took to run them (bench/job_queue.py). SQLite (embedded mode) goes through the
ORM, a statement at a time.
"""

from __future__ import annotations

from typing import Any

from django.db import connection

from controlplane import json_rows
from controlplane.accounts.models import Org
from controlplane.billing import budgets
from controlplane.catalog.models import Price, price_in_effect
from controlplane.events.models import Event
from controlplane.jobs.models import SETTLED_FIELDS, Job, Settlement, instances_from_row

# What settling writes to the job row, besides SETTLED_FIELDS.
WRITTEN_FIELDS = [*SETTLED_FIELDS, "attempts", "error", "result"]


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
