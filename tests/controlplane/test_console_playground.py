"""The console playground with Django's test client: a console session's turn is admitted by the
API's own path under its org's hidden "Console playground" key; bad input is OpenAI's error shape;
roles and orgs are enforced; no response ever carries a key's secret.

No node runs here, so the turns ask `queue: true` (admitted, answered 202 with the job, as the
API does): admission is what this tests; the browser test streams real turns. Admission runs in a
worker thread with its own connection, so the fixtures are committed (transaction=True).
"""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from controlplane.accounts.models import ApiKey, Membership
from controlplane.billing.models import UsageRecord
from controlplane.console.playground import CONSOLE_KEY_NAME
from controlplane.jobs.models import Job
from tests.controlplane.openai_spec import validate

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/console/playground/chat"
# A whole API key, as `ApiKey.objects.create_key` makes them: never in any response here.
FULL_KEY = re.compile(rb"hk_[0-9a-f]{12}_[A-Za-z0-9_-]{43}")


def signed_in(org, username: str, role: str = Membership.DEVELOPER, **client_options) -> Client:
    user = get_user_model().objects.create_user(username=username, password="pw")
    Membership.objects.create(org=org, user=user, role=role)
    client = Client(**client_options)
    client.force_login(user)
    return client


def turn(**fields) -> dict:
    return {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "hello"},
        ],
        "max_tokens": 4,
        "queue": True,
        **fields,
    }


def post_turn(client: Client, body, **headers):
    return client.post(CHAT, data=body, content_type="application/json", **headers)


def assert_no_secret(*responses) -> None:
    for response in responses:
        content = b"".join(response.streaming_content) if response.streaming else response.content
        headers = "\n".join(f"{k}: {v}" for k, v in response.items()).encode()
        assert not FULL_KEY.search(content) and not FULL_KEY.search(headers)


def test_a_turn_is_admitted_under_the_orgs_console_key(org_a, tiny):
    alice = signed_in(org_a, "alice")
    page = alice.get("/console/playground")
    assert page.status_code == 200
    assert (
        b'<option value="tiny"' in page.content and b"$0.6 / $0.1 cached / $3 out" in page.content
    )

    first = post_turn(alice, turn(), HTTP_X_SESSION_AFFINITY="conversation-1")
    assert first.status_code == 202, first.content
    job = Job.objects.select_related("api_key").get(id=first.json()["id"])
    assert job.org == org_a and job.api_key.name == CONSOLE_KEY_NAME
    assert job.request_id == first["x-request-id"]
    assert job.session_affinity == "conversation-1"
    assert job.request["messages"][1]["content"] == "hello"
    assert job.api_key.last_used_at is not None

    # The next turn reuses the key: one per org, listed on the keys page like any other.
    second = post_turn(alice, turn())
    assert Job.objects.get(id=second.json()["id"]).api_key_id == job.api_key_id
    assert ApiKey.objects.filter(org=org_a).count() == 1
    keys = alice.get("/console/keys")
    assert CONSOLE_KEY_NAME.encode() in keys.content

    shown = alice.get(f"/console/playground/turns/{job.request_id}")
    assert shown.status_code == 200
    assert shown.json() == {
        "id": job.id,
        "request_id": job.request_id,
        "status": "queued",
        "model": "tiny",
        "node": None,
        "prefill_node": None,
        "usage": None,
        "cost": None,
        "error": None,
        "ttft_s": None,
        "tpot_s": None,
        "e2e_s": None,
        "settled": False,
        "url": f"/console/jobs/{job.id}",
    }
    assert_no_secret(page, first, second, keys, shown, alice.get("/console/playground"))


def test_a_revoked_console_key_is_replaced_on_the_next_turn(org_a, tiny):
    alice = signed_in(org_a, "alice", role=Membership.ADMIN)
    first = post_turn(alice, turn())
    old = Job.objects.get(id=first.json()["id"]).api_key
    old.revoke()
    second = post_turn(alice, turn())
    assert second.status_code == 202
    new = Job.objects.get(id=second.json()["id"]).api_key
    assert new.pk != old.pk and new.name == CONSOLE_KEY_NAME and new.revoked_at is None


@pytest.mark.parametrize(
    ("fields", "status", "code", "param"),
    [
        ({"temperature": "hot"}, 400, "invalid_type", "temperature"),
        ({"top_p": 0}, 400, "invalid_value", "top_p"),
        ({"tools": [{"type": "function"}]}, 400, None, None),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            400,
            None,
            None,
        ),
        ({"model": "gpt-9"}, 404, "model_not_found", "model"),
    ],
)
def test_bad_input_is_refused_in_openais_error_shape(org_a, tiny, fields, status, code, param):
    response = post_turn(signed_in(org_a, "alice"), turn(**fields))
    assert response.status_code == status, response.content
    body = response.json()
    validate(body, "ErrorResponse")
    assert (code is None or body["error"]["code"] == code) and body["error"]["message"]
    assert param is None or body["error"]["param"] == param
    assert not Job.objects.exists() and not UsageRecord.objects.exists()


def test_malformed_json_and_an_exhausted_budget_are_refused_too(org_a, tiny):
    alice = signed_in(org_a, "alice")
    malformed = post_turn(alice, b'{"model": "tiny",')
    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "invalid_json"

    org_a.monthly_budget_usd = Decimal("0")
    org_a.save()
    over = post_turn(alice, turn())
    assert over.status_code == 402, over.content
    validate(over.json(), "ErrorResponse")
    assert over.json()["error"]["code"] == "budget_exceeded"
    assert not Job.objects.exists()


def test_the_chat_needs_the_pages_csrf_token(org_a, tiny):
    alice = signed_in(org_a, "alice", enforce_csrf_checks=True)
    assert post_turn(alice, turn()).status_code == 403
    alice.get("/console/playground")  # sets the CSRF cookie, as the page does
    token = alice.cookies["csrftoken"].value
    assert post_turn(alice, turn(), HTTP_X_CSRFTOKEN=token).status_code == 202


def test_a_billing_viewer_may_not_use_the_playground(org_a, tiny):
    viewer = signed_in(org_a, "bill", role=Membership.BILLING)
    assert viewer.get("/console/playground").status_code == 403
    assert post_turn(viewer, turn()).status_code == 403
    assert b'href="/console/playground"' not in viewer.get("/console/billing").content
    assert not Job.objects.exists() and not ApiKey.objects.exists()


def test_anonymous_visitors_are_sent_to_sign_in(client, org_a, tiny):
    response = post_turn(client, turn())
    assert response.status_code == 302 and response["Location"].startswith("/console/login")
    assert not Job.objects.exists()


def test_a_session_acts_only_for_its_own_org(org_a, org_b, tiny):
    alice, bob = signed_in(org_a, "alice"), signed_in(org_b, "bob")
    alices = Job.objects.get(id=post_turn(alice, turn()).json()["id"])
    bobs = Job.objects.select_related("api_key").get(id=post_turn(bob, turn()).json()["id"])
    assert bobs.org == org_b and bobs.api_key.org == org_b
    assert bobs.api_key_id != alices.api_key_id
    # Neither sees the other's turn.
    assert bob.get(f"/console/playground/turns/{alices.request_id}").status_code == 404
    assert alice.get(f"/console/playground/turns/{bobs.request_id}").status_code == 404
    assert alice.get(f"/console/playground/turns/{alices.request_id}").status_code == 200
