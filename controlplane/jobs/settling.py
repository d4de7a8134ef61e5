"""The reads and writes of settling a job from its node's result (`JobManager.record_completion`
decides; this reads the job and writes the outcome).

Every job is settled once by the worker, so this is the control plane's busiest transaction
after admission. On PostgreSQL it is three round trips: a SELECT … FOR UPDATE that returns the
job with its org and the price in effect when it was admitted; one query that carries the usage
row's INSERT, the job's UPDATE, the budgets' settlement, the org's event lock and the events'
INSERT (EventManager.emit_all); the COMMIT. They are written out rather than built by the ORM:
compiling a `select_for_update().select_related()`, a price query and three saves cost the
worker more CPU than PostgreSQL took to run them (bench/job_queue.py). SQLite (embedded mode)
goes through the ORM, a statement at a time.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django.db import connection
from django.db.models.sql import InsertQuery

from controlplane.accounts.models import Org
from controlplane.billing import budgets
from controlplane.billing.models import UsageRecord
from controlplane.catalog.models import Price, price_in_effect
from controlplane.events.models import Event
from controlplane.jobs.models import SETTLED_FIELDS, Job, instances_from_row

# What settling writes to the job row, besides SETTLED_FIELDS.
WRITTEN_FIELDS = [*SETTLED_FIELDS, "attempts", "error", "result"]


def lock_for_settling(request_id: str) -> tuple[Job, Price | None] | None:
    """The job of `request_id` under its row lock (serialising concurrent deliveries of one
    result), with its org, and the price in effect when it was admitted; None if unknown."""
    if connection.vendor != "postgresql":
        job = Job.objects.select_for_update().select_related("org").filter(request_id=request_id)
        job = job.first()
        return None if job is None else (job, price_in_effect(job.model, job.created))
    parts = [(Job, "j"), (Org, "o"), (Price, "p")]
    columns = [f'{a}."{f.column}"' for model, a in parts for f in model._meta.concrete_fields]
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {', '.join(columns)} FROM {Job._meta.db_table} j "
            f"JOIN {Org._meta.db_table} o ON o.id = j.org_id "
            f"LEFT JOIN LATERAL (SELECT * FROM {Price._meta.db_table} "
            "WHERE model_id = j.model AND effective_from <= j.created "
            "ORDER BY effective_from DESC LIMIT 1) p ON true "
            "WHERE j.request_id = %s FOR UPDATE OF j",
            [request_id],
        )
        row = cursor.fetchone()
    if row is None:
        return None
    job, job.org, price = instances_from_row(row, [Job, Org, Price])  # price None: none in effect
    return job, price


def write_settlement(
    job: Job, record: UsageRecord | None, cost: Decimal, events: list[tuple[str, dict[str, Any]]]
) -> None:
    """Write the settled `job`, its usage row (None: nothing billed), the budgets' settlement
    of `cost` and `events` (type, data), inside the caller's transaction."""
    if connection.vendor != "postgresql":
        if record is not None:
            record.save(force_insert=True)
        job.save(update_fields=WRITTEN_FIELDS)
        budgets.settle(job, cost)
        Event.objects.emit_all([(job.org, type, data) for type, data in events])
        return
    statements = []
    if record is not None:
        statements.append(_insert(record))
    statements.append(_update(job, WRITTEN_FIELDS))
    settlement = budgets.settle_statement(job, cost)
    if settlement is not None:
        statements.append(settlement)
    sql = ";\n".join(statement for statement, _ in statements)
    params = [value for _, values in statements for value in values]
    Event.objects.emit_all([(job.org, type, data) for type, data in events], first=(sql, params))
    if record is not None:
        record._state.adding, record._state.db = False, connection.alias


def _insert(row) -> tuple[str, list[Any]]:
    """The INSERT of an unsaved row whose primary key the database assigns (no RETURNING)."""
    meta = row._meta
    fields = [f for f in meta.concrete_fields if not f.generated and f is not meta.auto_field]
    query = InsertQuery(type(row))
    query.insert_values(fields, [row])
    [(sql, params)] = query.get_compiler(connection=connection).as_sql()
    return sql, list(params)


def _update(row, names: list[str]) -> tuple[str, list[Any]]:
    """The UPDATE of `names` of a loaded row, by primary key."""
    fields = [row._meta.get_field(name) for name in names]
    assignments = ", ".join(f'"{f.column}" = %s' for f in fields)
    params = [f.get_db_prep_save(getattr(row, f.attname), connection) for f in fields]
    pk = row._meta.pk
    return (
        f'UPDATE {row._meta.db_table} SET {assignments} WHERE "{pk.column}" = %s',
        [*params, pk.get_db_prep_value(row.pk, connection)],
    )
