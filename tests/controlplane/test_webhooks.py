"""Webhook endpoints and their signed deliveries (Standard Webhooks), against a real HTTP receiver
that verifies every request with the `standardwebhooks` package, as a customer's server would."""

from __future__ import annotations

import base64
import json
import socket
import time
from datetime import timedelta

import dramatiq
import pytest
from django.utils import timezone
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from controlplane.events.models import Event
from controlplane.events.webhooks import WebhookDelivery, WebhookEndpoint
from inference.protocol.messages import CONTROLPLANE_QUEUE

PUBLIC_ADDRESS = "93.184.215.14"


@pytest.fixture
def allow_private(settings):
    settings.WEBHOOK_ALLOW_PRIVATE = True


@pytest.fixture
def dns(monkeypatch):
    """Host names the resolver answers with an address of the test's choosing."""
    names: dict[str, str] = {}
    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        return real_getaddrinfo(names.get(host, host), port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return names


@pytest.fixture
def worker(settings):
    """The control plane's Dramatiq worker on the test broker, with retries due at once."""
    import controlplane.events.tasks  # noqa: F401  (registers the actors, as rundramatiq does)

    settings.WEBHOOK_RETRY_SCHEDULE_S = [0]
    broker = dramatiq.get_broker()
    broker.flush_all()
    worker = dramatiq.Worker(
        broker, queues={CONTROLPLANE_QUEUE}, worker_threads=2, worker_timeout=50
    )
    worker.start()
    yield worker
    worker.stop()
    broker.flush_all()


def drain(worker: dramatiq.Worker) -> None:
    """Wait until the control plane's queue is empty and its messages are done."""
    worker.broker.join(CONTROLPLANE_QUEUE, timeout=10_000)
    worker.join()


def wait_until(predicate, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out waiting")


def post(client, path: str, key: str, body: dict | None = None):
    return client.post(
        path,
        data=json.dumps(body or {}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {key}",
    )


def register(client, key: str, url: str, **fields) -> dict:
    response = post(client, "/v1/webhook_endpoints", key, {"url": url, **fields})
    assert response.status_code == 201, response.json()
    return response.json()


def attempt(delivery_id: str) -> WebhookDelivery | None:
    """One run of `deliver_webhook` without its enqueueing: claim, send, return the next attempt."""
    delivery = WebhookDelivery.objects.claim(delivery_id)
    assert delivery is not None
    return delivery.send()


def deliveries(client, key: str, endpoint_id: str) -> list[dict]:
    response = client.get(
        f"/v1/webhook_endpoints/{endpoint_id}/deliveries", HTTP_AUTHORIZATION=f"Bearer {key}"
    )
    assert response.status_code == 200
    return response.json()["data"]


def verified(secret: str, request: tuple[dict[str, str], bytes]) -> dict:
    headers, body = request
    return Webhook(secret).verify(body, headers)


# Registration and management


def test_it_registers_an_endpoint_and_shows_the_secret_once(client, key_a, dns):
    dns["hooks.example.com"] = PUBLIC_ADDRESS
    created = register(
        client,
        key_a,
        "https://hooks.example.com/hearth",
        event_types=["job.completed", "job.failed"],
        description="billing sync",
    )
    assert created["id"].startswith("we_") and created["object"] == "webhook_endpoint"
    assert created["event_types"] == ["job.completed", "job.failed"]
    assert created["enabled"] is True and created["disabled_reason"] is None
    assert created["secret"].startswith("whsec_")
    assert len(base64.b64decode(created["secret"].removeprefix("whsec_"))) == 24

    auth = {"HTTP_AUTHORIZATION": f"Bearer {key_a}"}
    detail = client.get(f"/v1/webhook_endpoints/{created['id']}", **auth).json()
    listing = client.get("/v1/webhook_endpoints", **auth).json()
    assert listing["object"] == "list" and [e["id"] for e in listing["data"]] == [created["id"]]
    without_secret = {k: v for k, v in created.items() if k != "secret"}
    assert detail == listing["data"][0] == without_secret
    assert created["secret"] not in json.dumps([detail, listing])


def test_it_deletes_an_endpoint(client, key_a, allow_private, receiver):
    endpoint = register(client, key_a, receiver.url)
    auth = {"HTTP_AUTHORIZATION": f"Bearer {key_a}"}
    response = client.delete(f"/v1/webhook_endpoints/{endpoint['id']}", **auth)
    assert response.status_code == 200
    assert response.json() == {"id": endpoint["id"], "object": "webhook_endpoint", "deleted": True}
    assert client.get(f"/v1/webhook_endpoints/{endpoint['id']}", **auth).status_code == 404
    assert not WebhookEndpoint.objects.exists()


def test_another_orgs_endpoint_is_a_404(client, key_a, key_b, allow_private, receiver):
    endpoint = register(client, key_a, receiver.url)
    path = f"/v1/webhook_endpoints/{endpoint['id']}"
    auth_b = {"HTTP_AUTHORIZATION": f"Bearer {key_b}"}
    for response in (
        client.get(path, **auth_b),
        client.get(f"{path}/deliveries", **auth_b),
        post(client, f"{path}/rotate_secret", key_b),
        client.delete(path, **auth_b),
    ):
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "webhook_endpoint_not_found"
    assert client.get("/v1/webhook_endpoints", **auth_b).json()["data"] == []
    assert WebhookEndpoint.objects.get().secret == endpoint["secret"]


def test_it_requires_an_api_key(client):
    assert client.get("/v1/webhook_endpoints").status_code == 401


@pytest.mark.parametrize(
    "url",
    ["ftp://hooks.example.com/x", "javascript:alert(1)", "http:///no-host", "hooks.example.com/x"],
)
def test_it_refuses_a_url_that_is_not_http_with_a_host(client, key_a, url):
    response = post(client, "/v1/webhook_endpoints", key_a, {"url": url})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "url" and error["code"] == "invalid_value"


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000/hook",
        "http://10.0.0.5/hook",
        "http://169.254.169.254/latest/meta-data",
        "http://[::1]/hook",
        "http://[::ffff:127.0.0.1]/hook",
        "http://0.0.0.0/hook",
        "http://224.0.0.1/hook",
        "http://100.64.0.1/hook",
        "http://localhost/hook",
    ],
)
def test_it_refuses_a_private_url(client, key_a, url):
    response = post(client, "/v1/webhook_endpoints", key_a, {"url": url})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "url" and error["code"] == "url_not_allowed"
    assert not WebhookEndpoint.objects.exists()


def test_it_refuses_a_host_name_that_resolves_to_a_private_address(client, key_a, dns):
    dns["intranet.example.com"] = "10.1.2.3"
    response = post(client, "/v1/webhook_endpoints", key_a, {"url": "https://intranet.example.com"})
    assert response.json()["error"]["code"] == "url_not_allowed"


def test_it_allows_a_private_url_when_the_setting_does(client, key_a, allow_private):
    register(client, key_a, "http://127.0.0.1:8000/hook")
    register(client, key_a, "http://10.0.0.5/hook")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"url": "https://93.184.215.14/", "event_types": ["job.exploded"]}, "event_types"),
        ({"url": "https://93.184.215.14/", "event_types": "job.completed"}, "event_types"),
        ({"url": "https://93.184.215.14/", "description": 7}, "description"),
        ({"event_types": ["job.completed"]}, "url"),
    ],
)
def test_it_refuses_an_invalid_registration(client, key_a, body, param):
    response = post(client, "/v1/webhook_endpoints", key_a, body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


# Deliveries, one step at a time


def test_rotating_the_secret_shows_the_new_one_once_and_only_it_verifies(
    client, key_a, org_a, allow_private, receiver
):
    endpoint = register(client, key_a, receiver.url)
    first = Event.objects.emit(org_a, "job.completed", {"id": "job_1"})
    [delivery_id] = WebhookDelivery.objects.fan_out(first.sequence)
    attempt(delivery_id)

    rotated = post(client, f"/v1/webhook_endpoints/{endpoint['id']}/rotate_secret", key_a)
    assert rotated.status_code == 200
    new_secret = rotated.json()["secret"]
    assert new_secret.startswith("whsec_") and new_secret != endpoint["secret"]
    detail = client.get(
        f"/v1/webhook_endpoints/{endpoint['id']}", HTTP_AUTHORIZATION=f"Bearer {key_a}"
    )
    assert "secret" not in detail.json()

    second = Event.objects.emit(org_a, "job.completed", {"id": "job_2"})
    [delivery_id] = WebhookDelivery.objects.fan_out(second.sequence)
    attempt(delivery_id)
    before, after = receiver.requests
    assert verified(endpoint["secret"], before)["id"] == first.id
    assert verified(new_secret, after)["id"] == second.id
    with pytest.raises(WebhookVerificationError):
        verified(endpoint["secret"], after)


def test_a_410_disables_the_endpoint_and_stops_its_deliveries(
    client, key_a, org_a, allow_private, receiver
):
    endpoint = register(client, key_a, receiver.url)
    receiver.script = [(0, 410)]
    event = Event.objects.emit(org_a, "job.completed", {"id": "job_1"})
    [delivery_id] = WebhookDelivery.objects.fan_out(event.sequence)
    assert attempt(delivery_id) is None

    detail = client.get(
        f"/v1/webhook_endpoints/{endpoint['id']}", HTTP_AUTHORIZATION=f"Bearer {key_a}"
    ).json()
    assert detail["enabled"] is False and "410" in detail["disabled_reason"]
    [logged] = deliveries(client, key_a, endpoint["id"])
    assert logged["status"] == "failed" and logged["response_status_code"] == 410
    assert logged["next_attempt_at"] is None
    later = Event.objects.emit(org_a, "job.completed", {"id": "job_2"})
    assert WebhookDelivery.objects.fan_out(later.sequence) == []
    assert len(receiver.requests) == 1


def test_an_endpoint_gets_only_the_event_types_it_asked_for(
    client, key_a, key_b, org_a, allow_private, receiver
):
    completed_only = register(client, key_a, receiver.url, event_types=["job.completed"])
    everything = register(client, key_a, receiver.url)
    register(client, key_b, receiver.url)  # another org's endpoint never gets org_a's events
    queued = Event.objects.emit(org_a, "job.queued", {"id": "job_1"})
    completed = Event.objects.emit(org_a, "job.completed", {"id": "job_1"})

    WebhookDelivery.objects.fan_out(queued.sequence)
    WebhookDelivery.objects.fan_out(completed.sequence)
    sent = {(d.endpoint_id, d.event.type) for d in WebhookDelivery.objects.select_related("event")}
    assert sent == {
        (everything["id"], "job.queued"),
        (everything["id"], "job.completed"),
        (completed_only["id"], "job.completed"),
    }


def test_it_gives_up_after_the_last_attempt(
    client, key_a, org_a, allow_private, receiver, settings
):
    settings.WEBHOOK_MAX_ATTEMPTS = 2
    endpoint = register(client, key_a, receiver.url)
    receiver.script = [(0, 503), (0, 503)]
    event = Event.objects.emit(org_a, "job.completed", {"id": "job_1"})
    [delivery_id] = WebhookDelivery.objects.fan_out(event.sequence)
    retry = attempt(delivery_id)
    assert retry is not None and retry.attempt == 2
    assert retry.scheduled_at <= timezone.now() + timedelta(seconds=5)  # the first step: 5 s
    assert attempt(retry.pk) is None
    second, first = deliveries(client, key_a, endpoint["id"])
    assert (first["attempt"], first["status"], first["response_status_code"]) == (1, "failed", 503)
    assert first["next_attempt_at"] == int(retry.scheduled_at.timestamp())
    assert (second["attempt"], second["status"], second["next_attempt_at"]) == (2, "failed", None)
    assert second["response_body"] == "thanks" and second["error"] == "the endpoint answered 503"


def test_a_host_that_turns_private_is_refused_at_delivery(client, key_a, org_a, receiver, dns):
    """DNS answered a public address at registration and the receiver's loopback one since:
    nothing is sent, the attempt is logged as failed and retried later."""
    dns["hooks.example.com"] = PUBLIC_ADDRESS
    endpoint = register(client, key_a, f"http://hooks.example.com:{receiver.port}/hooks")
    dns["hooks.example.com"] = "127.0.0.1"
    event = Event.objects.emit(org_a, "job.completed", {"id": "job_1"})
    [delivery_id] = WebhookDelivery.objects.fan_out(event.sequence)
    assert attempt(delivery_id) is not None
    retry, logged = deliveries(client, key_a, endpoint["id"])
    assert (retry["attempt"], retry["status"]) == (2, "pending")
    assert logged["status"] == "failed" and logged["response_status_code"] is None
    assert logged["error"].startswith("url_not_allowed")
    assert receiver.requests == []


def test_it_connects_to_the_address_it_checked_and_names_the_host(
    client, key_a, org_a, allow_private, receiver, dns
):
    dns["hooks.example.com"] = "127.0.0.1"
    endpoint = register(client, key_a, f"http://hooks.example.com:{receiver.port}/hooks")
    event = Event.objects.emit(org_a, "job.completed", {"id": "job_1"})
    [delivery_id] = WebhookDelivery.objects.fan_out(event.sequence)
    assert attempt(delivery_id) is None
    [(headers, _)] = receiver.requests
    assert headers["host"] == f"hooks.example.com:{receiver.port}"
    assert verified(endpoint["secret"], receiver.requests[0])["id"] == event.id


def test_an_attempt_is_claimed_once_unless_its_sender_died(org_a, allow_private, receiver):
    endpoint = WebhookEndpoint.objects.register(org_a, receiver.url)
    event = Event.objects.emit(org_a, "job.completed", {"id": "job_1"})
    assert WebhookDelivery.objects.fan_out(event.sequence) == WebhookDelivery.objects.fan_out(
        event.sequence
    )
    delivery = WebhookDelivery.objects.get(endpoint=endpoint)
    assert WebhookDelivery.objects.claim(delivery.pk) is not None
    assert WebhookDelivery.objects.claim(delivery.pk) is None
    WebhookDelivery.objects.filter(pk=delivery.pk).update(
        claimed_at=timezone.now() - timedelta(minutes=5)
    )
    assert WebhookDelivery.objects.claim(delivery.pk) is not None


# End to end: emit → fan_out_event → deliver_webhook on a real worker


@pytest.mark.django_db(transaction=True)
def test_an_emitted_event_is_delivered_signed_and_logged(
    client, key_a, org_a, allow_private, receiver, worker
):
    endpoint = register(client, key_a, receiver.url, event_types=["job.completed"])
    Event.objects.emit(org_a, "job.queued", {"id": "job_1"})
    event = Event.objects.emit(org_a, "job.completed", {"id": "job_1", "status": "completed"})

    wait_until(lambda: receiver.requests)
    headers, body = receiver.requests[0]
    assert verified(endpoint["secret"], receiver.requests[0]) == event.as_message()
    assert headers["webhook-id"] == event.id and headers["content-type"] == "application/json"
    assert abs(int(headers["webhook-timestamp"]) - time.time()) < 60
    assert json.loads(body)["object"] == "event"

    [logged] = wait_until(
        lambda: [d for d in deliveries(client, key_a, endpoint["id"]) if d["status"] == "succeeded"]
    )
    assert logged["event_id"] == event.id and logged["event_type"] == "job.completed"
    assert (logged["attempt"], logged["response_status_code"]) == (1, 200)
    assert logged["duration_ms"] is not None and logged["error"] is None
    drain(worker)
    assert len(receiver.requests) == 1  # job.queued was not asked for


@pytest.mark.django_db(transaction=True)
def test_a_failing_receiver_is_retried_with_the_same_webhook_id(
    client, key_a, org_a, allow_private, receiver, worker, settings
):
    settings.WEBHOOK_TIMEOUT_S = 0.5
    receiver.script = [(0, 500), (1.5, 200)]  # an error, then too slow, then well
    endpoint = register(client, key_a, receiver.url)
    event = Event.objects.emit(org_a, "job.failed", {"id": "job_1"})

    wait_until(lambda: len(receiver.requests) == 3)
    assert {headers["webhook-id"] for headers, _ in receiver.requests} == {event.id}
    for request in receiver.requests:
        assert verified(endpoint["secret"], request)["id"] == event.id
    logged = wait_until(
        lambda: (
            (rows := deliveries(client, key_a, endpoint["id"]))[0]["status"] == "succeeded" and rows
        )
    )
    assert [(d["attempt"], d["status"]) for d in logged] == [
        (3, "succeeded"),
        (2, "failed"),
        (1, "failed"),
    ]
    assert logged[2]["response_status_code"] == 500 and logged[2]["next_attempt_at"] is not None
    assert logged[1]["response_status_code"] is None
    assert logged[1]["error"] == "timed out after 0.5 s"


@pytest.mark.django_db(transaction=True)
def test_a_redelivered_message_sends_nothing_twice(
    client, key_a, org_a, allow_private, receiver, worker
):
    from controlplane.events.tasks import deliver_webhook, fan_out_event

    register(client, key_a, receiver.url)
    event = Event.objects.emit(org_a, "job.completed", {"id": "job_1"})
    wait_until(lambda: WebhookDelivery.objects.filter(status=WebhookDelivery.SUCCEEDED).exists())
    delivery = WebhookDelivery.objects.get()

    fan_out_event.send(event.sequence)
    deliver_webhook.send(delivery.pk)
    drain(worker)
    assert len(receiver.requests) == 1
    assert WebhookDelivery.objects.count() == 1
