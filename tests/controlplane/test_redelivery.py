"""The sweep that sends again what the broker lost: jobs (controlplane/dispatch/redelivery.py) and
webhook work (controlplane/events/redelivery.py), on the real Redis broker. A loss is made the
way a Redis restart without persistence makes it: the broker's keys are gone."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import dramatiq
import pytest
from django.utils import timezone

from controlplane.dispatch.admission import admit
from controlplane.dispatch.redelivery import (
    _dispatch_again,
    redeliver_lost,
    redispatch_open,
    reroute_from_dead_nodes,
)
from controlplane.events.models import Event
from controlplane.events.redelivery import resend_lost_webhooks
from controlplane.events.webhooks import WebhookDelivery, WebhookEndpoint
from controlplane.jobs.models import Job
from inference.protocol.keyed_messages import (
    RECORD_SUFFIX,
    enqueue_keyed,
    enqueue_results,
    held_keys,
)
from inference.protocol.messages import CONTROLPLANE_QUEUE, RECORD_COMPLETION_ACTOR
from tests.waiting import wait_for

# Admission commits, and closes its connection as a request thread does.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def broker():
    broker = dramatiq.get_broker()
    broker.flush_all()
    yield broker
    broker.flush_all()


def lose_everything(broker) -> None:
    """What a Redis restarted without persistence leaves of this run's broker: nothing."""
    for key in broker.client.scan_iter(match=f"{broker.namespace}:*"):
        broker.client.delete(key)


def submit(key: str, model: str, text: str = "review this") -> Job:
    body = {"model": model, "prompt": text, "max_tokens": 4, "queue": True}
    return admit(f"Bearer {key}", json.dumps(body).encode(), Job.TEXT, None, None).job


def held(broker, job: Job) -> bool:
    job.refresh_from_db()
    return held_keys(broker, [(job.queue, job.message_key())])[0]


def message_args(broker, queue: str) -> list[dict]:
    consumer = broker.consume(queue, timeout=200)
    found = []
    while (message := next(consumer)) is not None:
        found.append(message.args[0])
        consumer.ack(message)
    consumer.close()
    return found


# Jobs


def test_a_job_the_broker_holds_is_left_alone(broker, key_a, tiny):
    job = submit(key_a, tiny.id)
    assert held(broker, job) and job.queue == "infer.tiny"
    assert redeliver_lost(grace_s=0) == 0
    job.refresh_from_db()
    assert job.dispatches == 1


def test_a_job_lost_with_the_broker_is_dispatched_again_once(broker, key_a, tiny):
    job = submit(key_a, tiny.id)
    lose_everything(broker)
    assert not held(broker, job)
    assert redeliver_lost(grace_s=60) == 0  # not yet past the grace period
    assert redeliver_lost(grace_s=0) == 1
    assert redeliver_lost(grace_s=0) == 0  # its new message is in the broker now
    job.refresh_from_db()
    assert (job.dispatches, job.status) == (2, Job.QUEUED)
    assert held(broker, job) and job.message_key().endswith(".2")
    [message] = message_args(broker, job.queue)
    assert message["request_id"] == job.request_id
    assert message["deadline"] == pytest.approx(job.deadline_at.timestamp())
    assert message["reply_channel"] is None


def test_a_running_job_whose_result_is_on_its_way_is_left_alone(broker, key_a, tiny):
    """The node acks its message only after enqueueing the result under `<key>.record`."""
    job = submit(key_a, tiny.id)
    Job.objects.record_started({"request_id": job.request_id, "node": "node-1"})
    assert message_args(broker, job.queue)  # taken and acked, as a node does
    assert not held(broker, job)
    result = dramatiq.Message(
        queue_name=CONTROLPLANE_QUEUE,
        actor_name=RECORD_COMPLETION_ACTOR,
        args=({"request_id": job.request_id},),
        kwargs={},
        options={},
    )
    enqueue_keyed(broker, result, job.message_key() + RECORD_SUFFIX)
    assert redeliver_lost(grace_s=0) == 0
    lose_everything(broker)  # now the result is lost too
    assert redeliver_lost(grace_s=0) == 1
    job.refresh_from_db()
    assert (job.status, job.dispatches) == (Job.RUNNING, 2)


def test_a_running_job_whose_result_waits_with_others_is_left_alone(broker, key_a, tiny):
    """A node reports what it finished within its report window in one message, indexed under
    each answered message's key; the sweep follows the index."""
    jobs = [submit(key_a, tiny.id, f"review change {i}") for i in range(2)]
    Job.objects.record_starts("node-1", [{"request_id": job.request_id} for job in jobs])
    assert len(message_args(broker, "infer.tiny")) == 2  # taken and acked, as a node does
    answered = [job.message_key() for job in jobs]
    results = dramatiq.Message(
        queue_name=CONTROLPLANE_QUEUE,
        actor_name=RECORD_COMPLETION_ACTOR,
        args=({"node": "node-1", "results": [], "answered": answered},),
        kwargs={},
        options={},
    )
    enqueue_results(broker, results, answered)
    assert redeliver_lost(grace_s=0) == 0
    # A worker took the message and settled nothing before it died: the message is acked, but
    # its index entries stay behind. They point at a message the broker no longer holds.
    message_args(broker, CONTROLPLANE_QUEUE)
    assert redeliver_lost(grace_s=0) == 2
    for job in jobs:
        job.refresh_from_db()
        assert (job.status, job.dispatches) == (Job.RUNNING, 2)


def test_settled_jobs_are_never_sent_again(broker, key_a, tiny):
    job = submit(key_a, tiny.id)
    job.cancel()
    lose_everything(broker)
    assert redeliver_lost(grace_s=0) == 0
    assert redispatch_open() == 0


def test_two_sweeps_racing_dispatch_a_job_once(broker, key_a, tiny):
    job = submit(key_a, tiny.id)
    lose_everything(broker)
    first, second = Job.objects.get(pk=job.pk), Job.objects.get(pk=job.pk)  # both read it
    assert _dispatch_again(first) == 1
    assert _dispatch_again(second) == 0
    assert Job.objects.get(pk=job.pk).dispatches == 2
    assert len(message_args(broker, "infer.tiny")) == 1


def test_embedded_start_up_sends_every_open_job_again(broker, key_a, tiny):
    jobs = [submit(key_a, tiny.id, f"job {n}") for n in range(3)]
    jobs[0].cancel()
    lose_everything(broker)
    assert redispatch_open() == 2
    assert sorted(m["request_id"] for m in message_args(broker, "infer.tiny")) == sorted(
        j.request_id for j in jobs[1:]
    )


# Webhooks


def test_an_org_without_endpoints_sends_no_fan_out(broker, org_a):
    event = Event.objects.emit(org_a, "job.queued", {"id": "job_1"})
    assert not event.fan_out_pending
    assert broker.client.hlen(f"{broker.namespace}:{CONTROLPLANE_QUEUE}.msgs") == 0


def test_a_fan_out_lost_with_the_broker_is_done_by_the_sweep(broker, org_a, settings):
    settings.WEBHOOK_ALLOW_PRIVATE = True
    endpoint = WebhookEndpoint.objects.register(org_a, "http://127.0.0.1:9/hooks")
    event = Event.objects.emit(org_a, "job.completed", {"id": "job_1"})
    assert event.fan_out_pending
    assert broker.client.hlen(f"{broker.namespace}:{CONTROLPLANE_QUEUE}.msgs") == 1
    lose_everything(broker)

    assert resend_lost_webhooks(grace_s=60) == 0
    assert resend_lost_webhooks(grace_s=0) == 1
    event.refresh_from_db()
    assert not event.fan_out_pending
    [delivery] = WebhookDelivery.objects.filter(event=event, endpoint=endpoint)
    assert delivery.status == WebhookDelivery.PENDING
    [message] = message_args(broker, CONTROLPLANE_QUEUE)
    assert message == delivery.pk


def test_an_attempt_lost_with_the_broker_is_resent_once_per_grace_period(broker, org_a, settings):
    settings.WEBHOOK_ALLOW_PRIVATE = True
    WebhookEndpoint.objects.register(org_a, "http://127.0.0.1:9/hooks")
    event = Event.objects.emit(org_a, "job.completed", {"id": "job_1"})
    [delivery_id] = WebhookDelivery.objects.fan_out(event.pk)
    WebhookDelivery.objects.filter(pk=delivery_id).update(
        scheduled_at=timezone.now() - timedelta(seconds=30)
    )
    assert resend_lost_webhooks(grace_s=10) == 1
    assert resend_lost_webhooks(grace_s=10) == 0  # due again only a grace period from now
    assert message_args(broker, CONTROLPLANE_QUEUE) == [event.sequence, delivery_id]  # fan-out too


def test_an_endpoint_gets_no_events_from_before_it_existed(broker, org_a, settings):
    settings.WEBHOOK_ALLOW_PRIVATE = True
    WebhookEndpoint.objects.register(org_a, "http://127.0.0.1:9/old")
    event = Event.objects.emit(org_a, "job.completed", {"id": "job_1"})
    later = WebhookEndpoint.objects.register(org_a, "http://127.0.0.1:9/new")
    WebhookEndpoint.objects.filter(pk=later.pk).update(created=event.created + timedelta(seconds=1))
    WebhookDelivery.objects.fan_out(event.pk)
    assert not WebhookDelivery.objects.filter(endpoint=later).exists()
    assert WebhookDelivery.objects.filter(event=event).count() == 1


def test_jobs_stranded_with_a_dead_node_are_dispatched_again_to_the_shared_queue(
    broker, key_a, tiny
):
    """A node's own queue is read by that node alone: when it stops heartbeating, the open jobs
    queued there or running on it go to the shared queue; a live node's are left alone."""
    from controlplane.catalog import registry
    from inference.protocol.heartbeat import MemoryHeartbeat
    from inference.protocol.messages import node_queue

    heartbeat = MemoryHeartbeat()
    heartbeat("alive", {"id": "alive", "model": tiny.id, "free_slots": 1}, 60)
    registry.use_memory_heartbeat(heartbeat)
    try:
        queued_dead, queued_live, running_dead = (submit(key_a, tiny.id) for _ in range(3))
        Job.objects.filter(pk=queued_dead.pk).update(queue=node_queue(tiny.id, "gone"))
        Job.objects.filter(pk=queued_live.pk).update(queue=node_queue(tiny.id, "alive"))
        Job.objects.record_started({"request_id": running_dead.request_id, "node": "gone"})
        assert reroute_from_dead_nodes(grace_s=60) == 0  # not yet past the grace period
        assert reroute_from_dead_nodes(grace_s=0) == 2
        assert reroute_from_dead_nodes(grace_s=0) == 0  # now on the shared queue
    finally:
        registry.use_memory_heartbeat(None)
    for job in (queued_dead, queued_live, running_dead):
        job.refresh_from_db()
    assert (queued_dead.queue, queued_dead.dispatches) == (f"infer.{tiny.id}", 2)
    assert (running_dead.queue, running_dead.dispatches) == (f"infer.{tiny.id}", 2)
    assert (queued_live.queue, queued_live.dispatches) == (node_queue(tiny.id, "alive"), 1)
    shared = {m["request_id"] for m in message_args(broker, f"infer.{tiny.id}")}
    assert {queued_dead.request_id, running_dead.request_id} <= shared


def test_a_node_quiet_past_its_heartbeat_but_not_for_long_keeps_its_jobs(
    broker, key_a, tiny, settings
):
    """On Redis: a node inside a long step outlives its heartbeat's TTL; its jobs stay until it
    has been silent for NODE_DEAD_AFTER_S (else they would run twice)."""
    import time

    import redis

    from inference.protocol.heartbeat import LAST_SEEN_PREFIX, NODE_KEY_PREFIX, RedisHeartbeat
    from inference.protocol.messages import node_queue

    settings.REDIS_URL = settings.DRAMATIQ_BROKER["OPTIONS"]["url"]  # the registry on Redis
    client = redis.Redis.from_url(settings.REDIS_URL)
    stalled, dead = f"stalled-{tiny.id}", f"dead-{tiny.id}"
    RedisHeartbeat(client)(stalled, {"id": stalled, "model": tiny.id}, 0.05)
    client.set(LAST_SEEN_PREFIX + dead, time.time() - settings.NODE_DEAD_AFTER_S - 1)
    wait_for(
        lambda: not client.exists(NODE_KEY_PREFIX + stalled), "the stalled node's state to expire"
    )
    try:
        on_stalled, on_dead = submit(key_a, tiny.id), submit(key_a, tiny.id)
        Job.objects.filter(pk=on_stalled.pk).update(queue=node_queue(tiny.id, stalled))
        Job.objects.filter(pk=on_dead.pk).update(queue=node_queue(tiny.id, dead))
        assert reroute_from_dead_nodes(grace_s=0) == 1
    finally:
        client.delete(LAST_SEEN_PREFIX + stalled, LAST_SEEN_PREFIX + dead)
    on_stalled.refresh_from_db()
    on_dead.refresh_from_db()
    assert on_stalled.queue == node_queue(tiny.id, stalled) and on_stalled.dispatches == 1
    assert on_dead.queue == f"infer.{tiny.id}" and on_dead.dispatches == 2


def test_a_result_whose_recording_failed_is_retried_under_its_key(broker):
    """Dramatiq retries a message whose actor raised (Retries: into the delay queue, then back):
    each of those is an enqueue, and the key must survive both, or the sweep would find neither
    of a job's messages while its result waits for the retry, and run the job again."""
    calls: list[float] = []

    @dramatiq.actor(broker=broker, queue_name="hearth-retry-test", min_backoff=200, max_retries=3)
    def flaky_record(payload: dict) -> None:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("a deadlock victim, say")

    message = flaky_record.message({"request_id": "r"})
    enqueue_keyed(broker, message, "r.1.record")
    worker = dramatiq.Worker(broker, queues={"hearth-retry-test"}, worker_threads=1)
    worker.start()
    seen = []
    try:
        deadline = time.monotonic() + 20
        while len(calls) < 2 and time.monotonic() < deadline:
            seen.append(held_keys(broker, [("hearth-retry-test", "r.1.record")])[0])
            time.sleep(0.005)
        worker.join()
    finally:
        worker.stop()
    assert len(calls) == 2 and all(seen), seen.count(False)
    assert held_keys(broker, [("hearth-retry-test", "r.1.record")]) == [False]  # recorded: acked
