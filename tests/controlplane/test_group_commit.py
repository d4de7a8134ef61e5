"""Group commit (controlplane/dispatch/group_commit.py): concurrent admissions share their
transactions, and each caller is told what it would be told alone."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import IntegrityError, connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.api.errors import ApiError
from controlplane.billing.budgets import SpendCounter
from controlplane.dispatch.admission import admit
from controlplane.dispatch.group_commit import PendingJob, write_group
from controlplane.events.models import Event
from controlplane.jobs.models import Job
from tests.waiting import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def pending(org, model, cost: Decimal | None = None, **fields) -> PendingJob:
    job = Job(
        org=org,
        model=model.id,
        mode=Job.ASYNC,
        request={"model": model.id, "prompt": "hi"},
        prompt_token_ids=[3, 4, 5],
        sampling={"temperature": 0.0, "max_tokens": 4},
        deadline_at=timezone.now() + timedelta(hours=1),
        **fields,
    )
    return PendingJob(job, cost)


def test_a_group_is_one_transaction_and_a_refusal_fails_only_its_job(org_a, tiny):
    org_a.monthly_budget_usd = Decimal("1")
    org_a.save()
    group = [pending(org_a, tiny, Decimal(c)) for c in ("0.4", "0.7", "0.5")]
    with CaptureQueriesContext(connection) as queries:
        write_group(group)
    first, refused, last = group
    assert first.error is None and last.error is None
    assert isinstance(refused.error, ApiError) and refused.error.status == 402
    assert refused.error.code == "budget_exceeded"
    written = set(Job.objects.values_list("id", flat=True))
    assert written == {first.job.id, last.job.id}
    assert sorted(e.data["id"] for e in Event.objects.filter(type="job.queued")) == sorted(written)
    assert SpendCounter.objects.get(org=org_a, scope="org").reserved == Decimal("0.9")
    # Both jobs in one INSERT, sent with the org's event lock and the events' INSERT as one
    # query, after the reservations; one commit.
    [insert] = [q["sql"] for q in queries.captured_queries if 'INSERT INTO "jobs_job"' in q["sql"]]
    assert insert.count("INSERT INTO") == 2 and "INSERT INTO events_event" in insert
    assert "pg_advisory_xact_lock" in insert
    assert sum(q["sql"] == "COMMIT" for q in queries.captured_queries) == 1


def test_a_group_without_budgets_is_one_query(org_a, tiny):
    group = [pending(org_a, tiny) for _ in range(3)]
    with CaptureQueriesContext(connection) as queries:
        write_group(group)
    assert [q["sql"].split(" ", 2)[:2] for q in queries.captured_queries] == [["INSERT", "INTO"]]
    events = Event.objects.filter(type="job.queued").order_by("sequence")
    assert [e.data["id"] for e in events] == [item.job.id for item in group]
    assert [e.sequence for e in events] == sorted(e.sequence for e in events)


def test_a_group_that_fails_is_written_one_job_at_a_time(org_a, tiny):
    [existing] = Job.objects.submit_all([pending(org_a, tiny).job])
    group = [pending(org_a, tiny), pending(org_a, tiny, request_id=existing.request_id)]
    group.append(pending(org_a, tiny))
    write_group(group)
    good, clash, other = group
    assert isinstance(clash.error, IntegrityError)
    assert good.error is None and other.error is None
    assert set(Job.objects.values_list("id", flat=True)) == {existing.id, good.job.id, other.job.id}
    assert Event.objects.filter(type="job.queued").count() == 3  # none for the clash


def test_concurrent_admissions_each_get_their_own_job_and_event(org_a, key_a, tiny):
    body = json.dumps({"model": tiny.id, "prompt": "review", "max_tokens": 4, "queue": True})
    jobs, errors = [], []

    def one() -> None:
        try:
            jobs.append(admit(f"Bearer {key_a}", body.encode(), Job.TEXT, None, None).job)
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=one) for _ in range(24)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len({job.id for job in jobs}) == 24
    assert set(Job.objects.values_list("id", flat=True)) == {job.id for job in jobs}
    events = list(Event.objects.filter(type="job.queued").order_by("sequence"))
    assert sorted(e.data["id"] for e in events) == sorted(job.id for job in jobs)
    assert all(job.created is not None and job.status == Job.QUEUED for job in jobs)


def waits_for_a_lock(cursor, pid: int, locktype: str) -> bool:
    """Whether backend `pid` waits for a lock of `locktype` (pg_locks: not granted)."""
    cursor.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = %s AND locktype = %s AND NOT granted)",
        [pid, locktype],
    )
    return cursor.fetchone()[0]


def test_a_job_aborted_as_a_deadlocks_victim_is_written_again(org_a, tiny, caplog):
    """A real deadlock on PostgreSQL: a rival transaction holds the org's event lock; the writer
    inserts its job and waits for that lock; the rival then inserts a job with the same id, which
    waits for the writer's row. The writer's deadlock check fires first (the rival's is put off),
    so PostgreSQL aborts the writer's transaction (40P01), which lets the rival's insert through;
    the rival rolls back, and the writer, writing the job again, succeeds."""
    from django.db import connections, transaction

    from controlplane.dispatch import group_commit
    from controlplane.events.models import EMIT_LOCK_NAMESPACE

    item = pending(org_a, tiny)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        [writer_pid] = cursor.fetchone()
    locked, rival_inserted = threading.Event(), threading.Event()
    rival_failed: list[BaseException] = []

    def rival() -> None:
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("SET LOCAL deadlock_timeout = '10s'")  # never the victim
                    cursor.execute(
                        "SELECT pg_advisory_xact_lock(%s, %s)", [EMIT_LOCK_NAMESPACE, org_a.pk]
                    )
                    locked.set()
                    wait_for(
                        lambda: waits_for_a_lock(cursor, writer_pid, "advisory"),
                        "the writer, its job inserted, to wait for the org's event lock",
                    )
                twin = pending(org_a, tiny).job
                twin.id, twin.request_id = item.job.id, item.job.request_id
                # Waits for the writer's row: a deadlock. It goes through once PostgreSQL has
                # aborted the writer's transaction.
                twin.save(force_insert=True)
                rival_inserted.set()
                transaction.set_rollback(True)  # gives the writer's retry its way
        except BaseException as error:  # reported below
            rival_failed.append(error)
        finally:
            connections.close_all()

    thread = threading.Thread(target=rival)
    thread.start()
    assert locked.wait(10)
    with caplog.at_level("WARNING", logger=group_commit.logger.name):
        write_group([item])
    thread.join(30)
    assert rival_failed == [] and rival_inserted.is_set()
    assert item.error is None
    # The writer's first try was PostgreSQL's deadlock victim, and the one retry wrote the job.
    retries = [r for r in caplog.records if r.getMessage().startswith("job write aborted")]
    assert len(retries) == 1, caplog.text
    [aborted] = retries[0].args
    assert group_commit.is_transient(aborted) and aborted.__cause__.sqlstate == "40P01"
    assert "deadlock detected" in str(aborted)
    job = Job.objects.get(pk=item.job.pk)
    assert job.status == Job.QUEUED
    assert Event.objects.filter(type="job.queued", data__id=job.id).count() == 1
