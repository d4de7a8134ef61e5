"""The whole path in production mode, driven by the official `openai` package: uvicorn, a node
process and the worker process, on PostgreSQL and Redis."""

from __future__ import annotations

import time

import pytest

from controlplane.billing.models import UsageRecord
from controlplane.events.models import Event
from controlplane.jobs.models import Job
from tests.e2e.user_path import exercise_user_path, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_openai_sdk_drives_the_production_stack(stack, tiny_model, acme_key):
    stack.start_node(tiny_model.id, "node-a")
    stack.wait_ready(tiny_model.id, nodes=1, api_key=acme_key)
    try:
        request_ids = exercise_user_path(stack.url, acme_key, tiny_model.id, "node-a")
    except Exception:
        print(stack.outputs())
        raise

    # Exactly one usage row per request, each agreeing with its job.
    wait_for(
        lambda: UsageRecord.objects.filter(request_id__in=request_ids).count() == len(request_ids),
        what="every usage row",
    )
    time.sleep(0.5)  # a duplicate row would show up now, not later
    assert UsageRecord.objects.count() == len(request_ids)
    jobs = Job.objects.filter(request_id__in=request_ids)
    assert jobs.count() == len(request_ids)
    for job in jobs:
        assert job.status == Job.COMPLETED and job.node == "node-a"
        record = UsageRecord.objects.get(request_id=job.request_id)
        usage = job.result["usage"]
        assert (record.prompt_tokens, record.cached_tokens, record.completion_tokens) == (
            usage["prompt_tokens"],
            usage["cached_tokens"],
            usage["completion_tokens"],
        )
        # One event per state change: queued, running, completed.
        types = list(
            Event.objects.filter(data__id=job.id)
            .order_by("sequence")
            .values_list("type", flat=True)
        )
        assert types == ["job.queued", "job.running", "job.completed"], (job.id, types)
