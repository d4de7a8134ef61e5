"""`Idempotency-Key` on the completion endpoints: replay, conflict, in-flight, expiry, org scope.

Queued requests (`queue: true`) answer 202 with a job without a node (the job waits on the test
Redis broker), so each test can count the Job rows a key let through. The views' ORM runs in
worker threads, hence committed fixtures (transaction=True).
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import openai
import pytest
from django.core.management import call_command
from django.db import connections
from django.test import Client
from django.utils import timezone

from controlplane.gateway.idempotency import request_fingerprint
from controlplane.gateway.models import IdempotencyKey
from controlplane.jobs.models import Job
from tests.controlplane.openai_spec import validate

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"


def send(client: Client, path: str, body, key: str, idempotency_key: str | None = None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {key}"}
    if idempotency_key is not None:
        headers["HTTP_IDEMPOTENCY_KEY"] = idempotency_key
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    return client.post(path, data=data, content_type="application/json", **headers)


@pytest.fixture
def post(client):
    def post(path: str, body, key: str, idempotency_key: str | None = None):
        return send(client, path, body, key, idempotency_key)

    return post


def queued(**fields) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "queue": True,
        **fields,
    }


def assert_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    body = response.json()
    validate(body, "ErrorResponse")
    assert body["error"]["code"] == code
    return body["error"]


def test_the_same_key_and_body_replay_the_first_job(post, tiny, key_a):
    first = post(CHAT, queued(), key_a, "retry-1")
    again = post(CHAT, queued(), key_a, "retry-1")
    assert first.status_code == again.status_code == 202
    assert again.json() == first.json()
    assert again.content == first.content
    assert again["x-request-id"] == first["x-request-id"]
    assert again["content-type"] == first["content-type"]
    assert again["idempotent-replayed"] == "true"
    assert not first.has_header("idempotent-replayed")
    assert Job.objects.count() == 1
    assert Job.objects.get().id == first.json()["id"]


def test_key_order_and_whitespace_in_the_body_do_not_matter(post, tiny, key_a):
    body = queued(temperature=0.5)
    first = post(TEXT, {"model": "tiny", "prompt": "hi", "queue": True}, key_a, "k")
    reordered = '{ "queue": true,\n "prompt": "hi", "model": "tiny" }'
    again = post(TEXT, reordered, key_a, "k")
    assert again["idempotent-replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert request_fingerprint("POST", CHAT, json.dumps(body).encode()) == request_fingerprint(
        "POST", CHAT, json.dumps(dict(reversed(body.items())), indent=2).encode()
    )
    assert Job.objects.count() == 1


def test_the_same_key_with_another_body_is_a_conflict(post, tiny, key_a):
    post(CHAT, queued(), key_a, "k")
    other = post(CHAT, queued(temperature=0.2), key_a, "k")
    error = assert_error(other, 409, "idempotency_key_conflict")
    assert error["param"] is None
    assert Job.objects.count() == 1


def test_the_same_key_on_another_endpoint_is_a_conflict(post, tiny, key_a):
    post(TEXT, {"model": "tiny", "prompt": "hi", "queue": True}, key_a, "k")
    other = post(CHAT, {"model": "tiny", "prompt": "hi", "queue": True}, key_a, "k")
    assert_error(other, 409, "idempotency_key_conflict")
    assert Job.objects.count() == 1


def test_keys_are_scoped_to_the_org(post, tiny, key_a, key_b):
    mine = post(CHAT, queued(), key_a, "shared")
    theirs = post(CHAT, queued(), key_b, "shared")
    assert mine.status_code == theirs.status_code == 202
    assert not theirs.has_header("idempotent-replayed")
    assert mine.json()["id"] != theirs.json()["id"]
    assert Job.objects.count() == 2
    assert IdempotencyKey.objects.filter(key="shared").count() == 2


def test_a_client_error_is_replayed(post, tiny, key_a):
    first = post(CHAT, queued(temperature="hot"), key_a, "bad")
    assert_error(first, 400, "invalid_type")
    again = post(CHAT, queued(temperature="hot"), key_a, "bad")
    assert_error(again, 400, "invalid_type")
    assert again.content == first.content
    assert again["idempotent-replayed"] == "true"
    assert IdempotencyKey.objects.get().response_status == 400


def test_a_transient_refusal_releases_the_key(post, tiny, key_a):
    # No node runs, so reject_if_busy is refused with a 429: a retry must run, not replay it.
    busy = post(CHAT, queued(queue=False, reject_if_busy=True), key_a, "k")
    assert_error(busy, 429, "out_of_capacity")
    assert not IdempotencyKey.objects.exists()
    retried = post(CHAT, queued(queue=False, reject_if_busy=True), key_a, "k")
    assert not retried.has_header("idempotent-replayed")


def test_a_server_error_releases_the_key(tiny, org_a):
    row, claimed = IdempotencyKey.objects.claim(org_a, "k", "f" * 64, "POST", CHAT)
    assert claimed
    row.settle(503, {}, b"{}")
    assert not IdempotencyKey.objects.exists()


def test_a_bad_api_key_is_answered_401_and_claims_nothing(post, tiny, key_a):
    response = post(CHAT, queued(), "hk_nope", "k")
    assert_error(response, 401, "invalid_api_key")
    assert not IdempotencyKey.objects.exists()


def test_an_expired_key_can_be_reused(post, tiny, key_a):
    first = post(CHAT, queued(), key_a, "k")
    IdempotencyKey.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    reused = post(CHAT, queued(temperature=0.3), key_a, "k")
    assert reused.status_code == 202
    assert not reused.has_header("idempotent-replayed")
    assert reused.json()["id"] != first.json()["id"]
    assert Job.objects.count() == 2
    assert IdempotencyKey.objects.get().expires_at > timezone.now() + timedelta(hours=23)


def test_a_key_over_255_characters_is_refused(post, tiny, key_a):
    error = assert_error(post(CHAT, queued(), key_a, "k" * 256), 400, "invalid_idempotency_key")
    assert "Idempotency-Key" in error["message"]
    assert error["param"] == "Idempotency-Key"
    assert not Job.objects.exists()
    assert post(CHAT, queued(), key_a, "k" * 255).status_code == 202


def test_a_key_still_in_flight_is_in_use(post, tiny, key_a, org_a):
    body = json.dumps(queued()).encode()
    IdempotencyKey.objects.claim(org_a, "k", request_fingerprint("POST", CHAT, body), "POST", CHAT)
    response = post(CHAT, body, key_a, "k")
    assert_error(response, 409, "idempotency_key_in_use")
    assert response["retry-after"] == "1"
    assert not Job.objects.exists()


def test_an_abandoned_claim_is_taken_over_after_its_lease(post, tiny, key_a, org_a):
    body = json.dumps(queued()).encode()
    IdempotencyKey.objects.claim(org_a, "k", request_fingerprint("POST", CHAT, body), "POST", CHAT)
    IdempotencyKey.objects.update(created=timezone.now() - timedelta(hours=1))
    assert post(CHAT, body, key_a, "k").status_code == 202
    assert Job.objects.count() == 1


def test_concurrent_requests_with_one_key_run_once(tiny, key_a):
    responses, start = [], threading.Barrier(4)

    def request():
        try:
            start.wait()
            responses.append(send(Client(), CHAT, queued(), key_a, "race"))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=request) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(responses) == 4
    assert Job.objects.count() == 1
    job_id = Job.objects.get().id
    for response in responses:
        if response.status_code == 409:
            assert response.json()["error"]["code"] == "idempotency_key_in_use"
        else:
            assert response.status_code == 202
            assert response.json()["id"] == job_id
    assert sum(not r.has_header("idempotent-replayed") and r.status_code == 202 for r in responses)


def test_a_streamed_response_is_not_replayed(post, tiny, key_a, org_a):
    # A live stream needs a node; its row is what the decorator stores when the stream starts.
    body = json.dumps(queued(queue=False, stream=True)).encode()
    row, _ = IdempotencyKey.objects.claim(
        org_a, "k", request_fingerprint("POST", CHAT, body), "POST", CHAT
    )
    row.settle(200, {"x-request-id": "req_first"}, None)
    error = assert_error(post(CHAT, body, key_a, "k"), 409, "idempotency_key_replay_unsupported")
    assert "req_first" in error["message"]
    assert not Job.objects.exists()


def test_requests_without_the_header_are_unaffected(post, tiny, key_a):
    first, second = post(CHAT, queued(), key_a), post(CHAT, queued(), key_a)
    assert first.json()["id"] != second.json()["id"]
    assert Job.objects.count() == 2
    assert not IdempotencyKey.objects.exists()


def test_purge_deletes_only_expired_keys(tiny, org_a, org_b):
    IdempotencyKey.objects.claim(org_a, "old", "f" * 64, "POST", CHAT)
    IdempotencyKey.objects.claim(org_b, "new", "f" * 64, "POST", CHAT)
    IdempotencyKey.objects.filter(key="old").update(expires_at=timezone.now())
    call_command("purge_idempotency_keys")
    assert list(IdempotencyKey.objects.values_list("key", flat=True)) == ["new"]


def test_the_official_sdk_sends_the_key_through_extra_headers(live_server, tiny, key_a):
    # The SDK adds Idempotency-Key by itself only for clients that name the header (OpenAI's
    # does not); `extra_headers` sends one on any call.
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=key_a, max_retries=0)

    def create():
        return client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            extra_body={"queue": True},
            extra_headers={"Idempotency-Key": "sdk-1"},
        )

    first, again = create(), create()
    assert first.status_code == again.status_code == 202
    assert again.headers["idempotent-replayed"] == "true"
    assert again.http_response.json()["id"] == first.http_response.json()["id"]
    assert Job.objects.count() == 1
