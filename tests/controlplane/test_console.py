"""The web console with Django's test client: login, API keys (the secret shown once), jobs, and
that nothing of another org is ever shown or changed."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from controlplane.accounts.models import ApiKey, KeyRejected, Membership, hash_secret
from controlplane.jobs.models import Job

PASSWORD = "correct horse battery"


def member_of(org, username: str):
    user = get_user_model().objects.create_user(username=username, password=PASSWORD)
    Membership.objects.create(org=org, user=user, role="owner")
    return user


@pytest.fixture
def console_a(org_a) -> Client:
    """A client signed in as a member of org A."""
    client = Client()
    client.force_login(member_of(org_a, "alice"))
    return client


@pytest.fixture
def console_b(org_b) -> Client:
    """A client signed in as a member of org B."""
    client = Client()
    client.force_login(member_of(org_b, "bob"))
    return client


def make_job(org, **fields) -> Job:
    fields.setdefault("model", "SmolLM2-135M-Instruct")
    return Job.objects.create(
        org=org, request={"messages": []}, prompt_token_ids=[1, 2, 3], **fields
    )


def shown_secret(html: str) -> str | None:
    match = re.search(r'id="new-key-secret">([^<]+)<', html)
    return match.group(1) if match else None


@pytest.mark.parametrize("path", ["/console/", "/console/keys", "/console/jobs"])
def test_it_sends_anonymous_visitors_to_the_login_page(client, db, path):
    response = client.get(path)
    assert response.status_code == 302
    assert response["Location"] == f"/console/login?next={path}"


def test_it_logs_in_with_a_password_and_out_only_by_post(org_a):
    member_of(org_a, "alice")
    client = Client()
    login_page = client.get("/console/login")
    assert login_page.status_code == 200
    assert b'name="csrfmiddlewaretoken"' in login_page.content

    wrong = client.post("/console/login", {"username": "alice", "password": "nope"})
    assert wrong.status_code == 200 and "_auth_user_id" not in client.session

    response = client.post("/console/login", {"username": "alice", "password": PASSWORD})
    assert response.status_code == 302 and response["Location"] == "/console/"
    assert client.get("/console/").status_code == 200  # the dashboard
    assert client.get("/console/jobs").status_code == 200

    assert client.get("/console/logout").status_code == 405
    assert client.post("/console/logout").status_code == 302
    assert client.get("/console/jobs").status_code == 302


def test_it_shows_a_new_keys_secret_once_and_stores_only_its_hash(console_a, org_a):
    response = console_a.post("/console/keys", {"name": "ci runner"})
    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"
    secret = shown_secret(response.content.decode())
    assert secret is not None and secret.startswith("hk_")

    key = ApiKey.objects.get(org=org_a, name="ci runner")
    assert secret == f"hk_{key.prefix}_{secret.split('_', 2)[2]}"
    assert key.secret_hash == hash_secret(secret.split("_", 2)[2])
    assert secret not in str(ApiKey.objects.filter(pk=key.pk).values().get())
    # The secret authenticates, and is never shown again.
    assert ApiKey.objects.authenticate(secret) == key
    again = console_a.get("/console/keys").content.decode()
    assert shown_secret(again) is None and secret not in again
    assert f"hk_{key.prefix}_…" in again


def test_it_refuses_a_key_without_a_name(console_a, org_a):
    response = console_a.post("/console/keys", {"name": "   "})
    assert response.status_code == 200
    assert shown_secret(response.content.decode()) is None
    assert not ApiKey.objects.filter(org=org_a).exists()


def test_it_lists_the_orgs_keys_with_prefix_use_and_status(console_a, org_a, org_b):
    active, _ = ApiKey.objects.create_key(org_a, "active one")
    revoked, _ = ApiKey.objects.create_key(org_a, "revoked one")
    revoked.revoke()
    expired, _ = ApiKey.objects.create_key(
        org_a, "expired one", expires_at=timezone.now() - timedelta(days=1)
    )
    used, _ = ApiKey.objects.create_key(org_a, "used one")
    used.touch()
    theirs, _ = ApiKey.objects.create_key(org_b, "globex key")

    html = console_a.get("/console/keys").content.decode()

    for key, status in [(active, "active"), (revoked, "revoked"), (expired, "expired")]:
        row = re.search(rf'<tr id="key-{key.pk}" data-status="(\w+)">(.*?)</tr>', html, re.S)
        assert row is not None and row.group(1) == status
        assert f"hk_{key.prefix}_…" in row.group(2) and key.name in row.group(2)
        assert "never" in row.group(2)
    used_row = re.search(rf'<tr id="key-{used.pk}".*?</tr>', html, re.S).group(0)
    assert "never" not in used_row and used.last_used_at.strftime("%Y-%m-%d") in used_row
    assert theirs.prefix not in html and "globex key" not in html


def test_it_revokes_a_key(console_a, org_a):
    key, secret = ApiKey.objects.create_key(org_a, "to revoke")
    response = console_a.post(f"/console/keys/{key.pk}/revoke")
    assert response.status_code == 302 and response["Location"] == "/console/keys"
    key.refresh_from_db()
    assert key.revoked_at is not None
    with pytest.raises(KeyRejected, match="revoked"):
        ApiKey.objects.authenticate(secret)
    assert 'data-status="revoked"' in console_a.get("/console/keys").content.decode()
    assert console_a.get(f"/console/keys/{key.pk}/revoke").status_code == 405


def test_it_answers_404_to_a_user_revoking_another_orgs_key(console_b, org_a):
    key, _ = ApiKey.objects.create_key(org_a, "not yours")
    assert console_b.post(f"/console/keys/{key.pk}/revoke").status_code == 404
    key.refresh_from_db()
    assert key.revoked_at is None


def test_it_requires_the_csrf_token_to_revoke(org_a):
    key, _ = ApiKey.objects.create_key(org_a, "csrf")
    client = Client(enforce_csrf_checks=True)
    client.force_login(member_of(org_a, "carol"))
    assert client.post(f"/console/keys/{key.pk}/revoke").status_code == 403
    key.refresh_from_db()
    assert key.revoked_at is None


def test_it_lists_only_the_orgs_own_jobs(console_a, org_a, org_b):
    ours = [make_job(org_a, mode=mode) for mode in ("sync", "async")]
    theirs = make_job(org_b)
    html = console_a.get("/console/jobs").content.decode()
    for job in ours:
        assert f'<tr id="job-{job.id}" data-status="queued">' in html
    assert theirs.id not in html


def test_it_shows_a_completed_jobs_tokens_cost_and_node(console_a, org_a):
    usage = {"prompt_tokens": 40, "cached_tokens": 32, "completion_tokens": 7}
    job = make_job(
        org_a,
        status=Job.COMPLETED,
        node="node-7",
        result={
            "text": "hi",
            "token_ids": [5],
            "finish_reason": "stop",
            "usage": usage,
            "cost": {"currency": "USD", "total": "0.0000477"},
        },
    )
    html = console_a.get("/console/jobs").content.decode()
    row = re.search(rf'<tr id="job-{job.id}" data-status="completed">(.*?)</tr>', html, re.S)
    assert row is not None
    cells = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row[1])]
    assert cells[:8] == [job.id, "completed", job.model, "sync", "40", "32", "7", "0.0000477"]
    assert cells[8] == "node-7"


def test_it_shows_only_the_newest_100_jobs(console_a, org_a):
    jobs = [make_job(org_a) for _ in range(101)]
    html = console_a.get("/console/jobs").content.decode()
    assert html.count('<tr id="job-') == 100
    assert jobs[0].id not in html and jobs[-1].id in html


def test_it_answers_404_to_a_user_in_no_org(db):
    client = Client()
    client.force_login(get_user_model().objects.create_user(username="loner", password=PASSWORD))
    assert client.get("/console/jobs").status_code == 404
    assert client.get("/console/keys").status_code == 404
