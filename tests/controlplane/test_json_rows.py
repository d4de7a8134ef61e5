"""Rows written as one JSON document (controlplane/json_rows.py) read back exactly as the ORM's
own INSERT and UPDATE write them, and the statement's text does not depend on the group's size."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal

import pytest
from django.db import connection, models

from controlplane import json_rows
from controlplane.jobs.models import Job

pytestmark = pytest.mark.django_db

AWKWARD_TEXT = (
    "quotes ' \" back\\slash; -- $1 %s %(x)s, accents é, CJK 漢字, emoji 🔥, tab\tnewline\n"
)


def awkward_job(org, model, **fields) -> Job:
    """A job whose columns hold what quoting and typing get wrong."""
    return Job(
        org=org,
        model=model.id,
        mode=Job.ASYNC,
        request={"model": model.id, "prompt": AWKWARD_TEXT, "nested": [None, {"x": 1.5}], "s": ""},
        prompt_token_ids=list(range(300)),
        sampling={"temperature": 0.7, "stop": [AWKWARD_TEXT], "seed": 2**40},
        result=None,
        error=AWKWARD_TEXT,
        session_affinity="session-é",
        deadline_at=datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=timezone(timedelta(hours=-5))),
        dispatched_at=datetime(2030, 1, 1, tzinfo=UTC),
        reserved_cost=Decimal("0.000000000001"),
        budget_scopes=["org", "key:7"],
        attempts=3,
        **fields,
    )


def columns(job: Job) -> dict:
    """Every column of the job as read back from the database, but its own ids and time."""
    job = Job.objects.get(pk=job.pk)
    skip = {"id", "request_id", "created"}
    return {
        f.attname: getattr(job, f.attname) for f in Job._meta.concrete_fields if f.name not in skip
    }


def test_an_insert_reads_back_as_the_orms_own(org_a, tiny):
    by_orm = awkward_job(org_a, tiny)
    by_orm.save(force_insert=True)
    by_document = awkward_job(org_a, tiny)
    sql, params = json_rows.insert(Job, Job._meta.concrete_fields, [by_document])
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
    assert by_document.created is not None  # pre_save ran, as the ORM's INSERT runs it
    assert columns(by_document) == columns(by_orm)
    assert Job.objects.get(pk=by_document.pk).created == by_document.created


def test_an_update_writes_each_row_by_its_key(org_a, tiny):
    jobs = [awkward_job(org_a, tiny) for _ in range(3)]
    for job in jobs:
        job.save(force_insert=True)
    jobs[0].status, jobs[0].result = Job.COMPLETED, {"text": AWKWARD_TEXT, "logprob": -0.25}
    jobs[1].status, jobs[1].error = Job.FAILED, "it broke: 'x'"
    jobs[2].finished_at = datetime(2030, 1, 2, 3, 4, 5, 6, tzinfo=UTC)
    fields = [Job._meta.get_field(n) for n in ("status", "result", "error", "finished_at")]
    sql, params = json_rows.update(Job, fields, jobs[:2] + jobs[2:])
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
    for job in jobs:
        expected = {f.attname: getattr(job, f.attname) for f in fields}
        assert {name: getattr(Job.objects.get(pk=job.pk), name) for name in expected} == expected


def test_the_statement_is_the_same_text_for_one_row_or_many(org_a, tiny):
    fields = Job._meta.concrete_fields
    one, _ = json_rows.insert(Job, fields, [awkward_job(org_a, tiny)])
    many, params = json_rows.insert(Job, fields, [awkward_job(org_a, tiny) for _ in range(40)])
    assert one == many and len(params) == 1


def test_a_value_json_cannot_carry_is_refused():
    with pytest.raises(TypeError, match="JSON cannot carry: set"):
        json_rows.column_value(models.Field(name="tags"), {"a", "b"})
