"""The jobs API: listing with a cursor, queue positions, cancel (queued and running), deadlines
that expire jobs, and the attempt cap; each state change one event, another org's job a 404."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import dramatiq
from django.core.management import call_command
from django.utils import timezone

from controlplane.billing.models import UsageRecord
from controlplane.events.models import Event
from controlplane.jobs.models import Job
from controlplane.jobs.settlement import record_completion
from inference.protocol.messages import ABORT_ACTOR, CompletionResult, Usage, control_queue
from tests.controlplane.openai_spec import validate

MODEL = "SmolLM2-135M-Instruct"


def make_job(org, **fields) -> Job:
    job = Job(
        org=org,
        model=MODEL,
        mode=Job.ASYNC,
        request={"model": MODEL, "prompt": "hi"},
        prompt_token_ids=[3, 4, 5, 6],
        sampling={"temperature": 0.0, "max_tokens": 8},
        deadline_at=timezone.now() + timedelta(hours=1),
        **fields,
    )
    [job] = Job.objects.submit_all([job])
    return job


def result_for(job: Job, finish_reason: str = "stop", completion: int = 5) -> CompletionResult:
    return CompletionResult(
        request_id=job.request_id,
        job_id=job.id,
        node="node-1",
        text="hello",
        token_ids=list(range(completion)),
        finish_reason=finish_reason,
        usage=Usage(4, 0, completion),
    )


def event_types(job: Job) -> list[str]:
    return [e.type for e in Event.objects.filter(data__id=job.id).order_by("sequence")]


def post(client, path: str, key: str):
    return client.post(path, HTTP_AUTHORIZATION=f"Bearer {key}")


def control_messages(model: str, node: str) -> list[dict]:
    consumer = dramatiq.get_broker().consume(control_queue(model, node), timeout=200)
    found = []
    while (message := next(consumer)) is not None:
        assert message.actor_name == ABORT_ACTOR
        found.append(message.args[0])
        consumer.ack(message)
    consumer.close()
    return found


def test_it_lists_the_orgs_jobs_newest_first_in_pages(api, org_a, org_b, key_a, smollm2):
    jobs = [make_job(org_a) for _ in range(5)]
    make_job(org_b)
    first = api.get("/v1/jobs?limit=2", key_a).json()
    assert [j["id"] for j in first["data"]] == [jobs[4].id, jobs[3].id]
    assert first["has_more"] and first["last_id"] == jobs[3].id
    second = api.get(f"/v1/jobs?limit=2&after={first['last_id']}", key_a).json()
    third = api.get(f"/v1/jobs?limit=2&after={second['last_id']}", key_a).json()
    assert [j["id"] for j in second["data"] + third["data"]] == [j.id for j in jobs[2::-1]]
    assert second["has_more"] and not third["has_more"]
    everything = api.get("/v1/jobs?limit=100", key_a).json()["data"]
    assert {j["id"] for j in everything} == {j.id for j in jobs}  # never another org's


def test_it_filters_by_status_and_refuses_bad_parameters(api, org_a, key_a, smollm2):
    queued, done = make_job(org_a), make_job(org_a)
    record_completion(result_for(done))
    data = api.get("/v1/jobs?status=completed", key_a).json()["data"]
    assert [j["id"] for j in data] == [done.id]
    assert [j["id"] for j in api.get("/v1/jobs?status=queued", key_a).json()["data"]] == [queued.id]
    for query, param in [
        ("status=finished", "status"),
        ("limit=0", "limit"),
        ("limit=abc", "limit"),
        ("limit=101", "limit"),
        ("after=job_nope", "after"),
    ]:
        response = api.get(f"/v1/jobs?{query}", key_a)
        assert response.status_code == 400, query
        validate(response.json(), "ErrorResponse")
        assert response.json()["error"]["param"] == param


def test_a_queued_job_shows_its_place_in_the_models_queue(api, org_a, org_b, key_a, smollm2):
    theirs = make_job(org_b)  # other orgs' jobs share the nodes, so they count
    mine = [make_job(org_a), make_job(org_a)]
    positions = [api.get(f"/v1/jobs/{job.id}", key_a).json()["queue_position"] for job in mine]
    assert positions == [1, 2]
    assert api.get(f"/v1/jobs/{mine[0].id}", key_a).json()["estimated_start_s"] is None
    record_completion(result_for(theirs))  # one completion: a throughput to go by
    body = api.get(f"/v1/jobs/{mine[1].id}", key_a).json()
    assert body["queue_position"] == 1 and body["estimated_start_s"] > 0


def test_cancelling_a_queued_job_settles_it_at_once(client, org_a, key_a, smollm2):
    job = make_job(org_a)
    response = post(client, f"/v1/jobs/{job.id}/cancel", key_a)
    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    # A second cancel changes nothing; a late start notice stops it on the node that took it.
    assert post(client, f"/v1/jobs/{job.id}/cancel", key_a).json()["status"] == "cancelled"
    Job.objects.record_started({"request_id": job.request_id, "node": "node-9"})
    assert not record_completion(result_for(job))
    assert event_types(job) == ["job.queued", "job.cancelled"]
    assert not UsageRecord.objects.exists()


def test_cancelling_a_running_job_stops_it_on_its_node_and_bills_what_it_generated(
    client, org_a, key_a, smollm2, django_capture_on_commit_callbacks
):
    job = make_job(org_a)
    Job.objects.record_started({"request_id": job.request_id, "node": "node-1"})
    with django_capture_on_commit_callbacks(execute=True):
        body = post(client, f"/v1/jobs/{job.id}/cancel", key_a).json()
    assert body["status"] == "running" and body["cancel_requested_at"] is not None
    assert control_messages(MODEL, "node-1") == [{"request_id": job.request_id}]
    # The node reports the request it stopped, with the 3 tokens it had generated.
    assert record_completion(result_for(job, "abort", completion=3))
    job.refresh_from_db()
    assert job.status == Job.CANCELLED and job.result["usage"]["completion_tokens"] == 3
    [record] = UsageRecord.objects.all()
    assert record.completion_tokens == 3 and record.request_id == job.request_id
    assert event_types(job) == ["job.queued", "job.running", "job.cancelled"]


def test_another_orgs_job_is_a_404(api, client, org_b, key_a, smollm2):
    job = make_job(org_b)
    for response in (
        api.get(f"/v1/jobs/{job.id}", key_a),
        post(client, f"/v1/jobs/{job.id}/cancel", key_a),
    ):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "job_not_found"
    assert Job.objects.get(pk=job.pk).status == Job.QUEUED


def test_a_queued_job_past_its_deadline_is_expired(api, org_a, key_a, smollm2):
    late, on_time = make_job(org_a), make_job(org_a)
    Job.objects.filter(pk=late.pk).update(deadline_at=timezone.now() - timedelta(seconds=1))
    body = api.get(f"/v1/jobs/{late.id}", key_a).json()
    assert body["status"] == "expired" and body["error"]["code"] == "deadline_exceeded"
    assert api.get(f"/v1/jobs/{on_time.id}", key_a).json()["status"] == "queued"
    assert event_types(late) == ["job.queued", "job.expired"]
    # A node that takes the expired message later reports it without running it: no change.
    record_completion(replace(result_for(late), error="late", error_code="expired"))
    assert event_types(late) == ["job.queued", "job.expired"]


def test_the_sweep_expires_every_orgs_overdue_jobs(org_a, org_b, smollm2):
    jobs = [make_job(org_a), make_job(org_b)]
    Job.objects.filter(pk__in=[j.pk for j in jobs]).update(
        deadline_at=timezone.now() - timedelta(minutes=1)
    )
    call_command("sweepjobs")
    assert set(Job.objects.values_list("status", flat=True)) == {Job.EXPIRED}


def test_a_running_job_that_hits_its_deadline_is_expired_and_billed(org_a, smollm2):
    job = make_job(org_a)
    Job.objects.record_started({"request_id": job.request_id, "node": "node-1"})
    assert record_completion(result_for(job, "deadline", completion=2))
    job.refresh_from_db()
    assert job.status == Job.EXPIRED and UsageRecord.objects.get().completion_tokens == 2


def test_a_job_that_keeps_killing_its_nodes_fails_after_the_attempt_limit(
    org_a, smollm2, settings, django_capture_on_commit_callbacks
):
    settings.JOB_MAX_ATTEMPTS = 3
    job = make_job(org_a)
    # Each node that took the (redelivered) message died before it finished.
    with django_capture_on_commit_callbacks(execute=True):
        for node in ("node-1", "node-2", "node-3", "node-4"):
            Job.objects.record_started({"request_id": job.request_id, "node": node})
    job.refresh_from_db()
    assert job.status == Job.FAILED and job.attempts == 4
    assert "started 3 times" in job.error
    # The fourth node is told to drop it, so the message stops going round.
    assert control_messages(MODEL, "node-4") == [{"request_id": job.request_id}]
    assert event_types(job) == ["job.queued", "job.running", "job.failed"]


def test_a_second_notice_of_the_same_start_counts_no_attempt(org_a, smollm2):
    job = make_job(org_a)
    notice = {"request_id": job.request_id, "node": "node-1", "attempt": 1}
    assert Job.objects.record_started(notice)
    assert not Job.objects.record_started(notice)  # the gateway recorded it first, say
    job.refresh_from_db()
    assert (job.status, job.attempts, job.node) == (Job.RUNNING, 1, "node-1")
    # Its message redelivered to another node after node-1 died: that is a second attempt.
    Job.objects.record_started({**notice, "node": "node-2"})
    job.refresh_from_db()
    assert (job.attempts, job.node) == (2, "node-2")
    assert event_types(job) == ["job.queued", "job.running"]


def test_a_start_announces_the_job_as_it_is_stored(org_a, smollm2):
    """The start is one statement returning the row (PostgreSQL): the `job.running` event must
    carry exactly what reading the job back gives, JSON fields and times included."""
    from controlplane.jobs.serializers import job_object

    job = make_job(org_a)
    assert Job.objects.record_started({"request_id": job.request_id, "node": "node-7"})
    job.refresh_from_db()
    [running] = Event.objects.filter(org=org_a, type="job.running")
    assert running.data == job_object(job)
    assert (running.data["status"], running.data["node"], running.data["attempts"]) == (
        Job.RUNNING,
        "node-7",
        1,
    )


def test_a_notice_of_a_report_windows_starts_runs_each_queued_job_once_in_order(
    org_a, smollm2, django_capture_on_commit_callbacks
):
    """A node sends the starts of a report window together: the queued jobs start in one statement
    with their events in the notice's order; a job cancelled while it waited is stopped on the
    node instead, an unknown request is skipped, and a repeat starts nothing."""
    first, second, cancelled = make_job(org_a), make_job(org_a), make_job(org_a)
    cancelled.cancel()
    starts = [{"request_id": job.request_id, "attempt": 1} for job in (second, cancelled, first)]
    starts.insert(2, {"request_id": "req_unknown", "attempt": 1})
    with django_capture_on_commit_callbacks(execute=True):
        assert Job.objects.record_starts("node-3", starts) == [True, False, False, True]
        assert Job.objects.record_starts("node-3", starts) == [False, False, False, False]
    for job in (first, second):
        job.refresh_from_db()
        assert (job.status, job.node, job.attempts) == (Job.RUNNING, "node-3", 1)
        assert event_types(job) == ["job.queued", "job.running"]
    running = Event.objects.filter(type="job.running").order_by("sequence")
    assert [event.data["id"] for event in running] == [second.id, first.id]
    assert control_messages(MODEL, "node-3") == [{"request_id": cancelled.request_id}] * 2
    assert event_types(cancelled) == ["job.queued", "job.cancelled"]


def test_a_start_notice_overtaken_by_its_own_result_changes_nothing(
    org_a, smollm2, django_capture_on_commit_callbacks
):
    """The worker takes a node's start and result messages in parallel, so a short job's result
    often settles it first: the late notice of that run must neither restart the job nor stop a
    request the node has already finished. A new run of it (another node, or a later attempt on
    the same one) is still stopped."""
    job = make_job(org_a)
    assert record_completion(result_for(job))  # from node-1, attempt 1
    notice = {"request_id": job.request_id, "attempt": 1}
    for node, attempt, stopped in [("node-1", 1, False), ("node-2", 1, True), ("node-1", 2, True)]:
        with django_capture_on_commit_callbacks(execute=True):
            assert Job.objects.record_starts(node, [{**notice, "attempt": attempt}]) == [False]
        expected = [{"request_id": job.request_id}] if stopped else []
        assert control_messages(MODEL, node) == expected, (node, attempt)
    job.refresh_from_db()
    assert (job.status, job.node, job.attempts) == (Job.COMPLETED, "node-1", 1)
    assert event_types(job) == ["job.queued", "job.running", "job.completed"]
    assert UsageRecord.objects.count() == 1
