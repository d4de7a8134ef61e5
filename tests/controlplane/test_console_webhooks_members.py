"""The console's webhooks and members pages with Django's test client: an endpoint's secret shown
once, the deliveries with their status and a Retry that re-queues a failed one, members invited,
re-roled and removed under the owner rules, and nothing of another org shown or changed."""

from __future__ import annotations

import re
from datetime import timedelta

import dramatiq
import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone
from dramatiq import Message

from controlplane.accounts.models import Membership
from controlplane.events.models import Event
from controlplane.events.tasks import deliver_webhook
from controlplane.events.webhooks import WebhookDelivery, WebhookEndpoint
from inference.protocol.messages import CONTROLPLANE_QUEUE
from tests.webhook_receiver import Receiver

PUBLIC_URL = "https://93.184.215.14/hooks"  # an IP literal: registering it needs no DNS


def signed_in(org, username: str, role: str) -> Client:
    """A client signed in as a new member of `org` with `role` (no password: force_login)."""
    user = get_user_model().objects.create(username=username)
    Membership.objects.create(org=org, user=user, role=role)
    client = Client()
    client.force_login(user)
    return client


def membership(org, username: str) -> Membership:
    return Membership.objects.get(org=org, user__username=username)


def member_of(org, username: str, role: str) -> Membership:
    user = get_user_model().objects.create(username=username)
    return Membership.objects.create(org=org, user=user, role=role)


@pytest.fixture
def owner_a(org_a) -> Client:
    return signed_in(org_a, "alice", "owner")


@pytest.fixture
def receiver(settings):
    settings.WEBHOOK_ALLOW_PRIVATE = True
    receiver = Receiver()
    yield receiver
    receiver.close()


@pytest.fixture
def broker():
    """The test broker, emptied before and after: what a view enqueued is read from it."""
    broker = dramatiq.get_broker()
    broker.flush_all()
    yield broker
    broker.flush_all()


def queued_deliveries(broker) -> list[str]:
    """The delivery ids `deliver_webhook` messages waiting on the control plane's queue name."""
    key = f"{broker.namespace}:{CONTROLPLANE_QUEUE}.msgs"
    messages = [Message.decode(raw) for raw in broker.client.hvals(key)]
    return [m.args[0] for m in messages if m.actor_name == deliver_webhook.actor_name]


def delivered(endpoint: WebhookEndpoint, event_type: str = "job.completed") -> WebhookDelivery:
    """One event of the endpoint's org, fanned out to it and sent once (as `deliver_webhook`
    does); the first attempt."""
    event = Event.objects.emit(endpoint.org, event_type, {"id": "job_1"})
    [delivery_id] = WebhookDelivery.objects.fan_out(event.sequence)
    WebhookDelivery.objects.claim(delivery_id).send()
    return WebhookDelivery.objects.get(pk=delivery_id)


def shown_secret(html: str) -> str | None:
    match = re.search(r'id="new-endpoint-secret">([^<]+)<', html)
    return match.group(1) if match else None


def delivery_row(html: str, delivery: WebhookDelivery) -> str:
    match = re.search(
        rf'<tr id="delivery-{delivery.pk}" data-status="(\w+)">(.*?)</tr>', html, re.S
    )
    assert match is not None, f"no row for {delivery.pk}"
    return match.group(0)


# Webhooks


def test_it_creates_an_endpoint_and_shows_its_secret_once(owner_a, org_a):
    response = owner_a.post(
        "/console/webhooks",
        {"url": PUBLIC_URL, "event_types": ["job.completed", "job.failed"], "description": "sync"},
    )
    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"
    endpoint = WebhookEndpoint.objects.get(org=org_a)
    assert shown_secret(response.content.decode()) == endpoint.secret
    assert endpoint.url == PUBLIC_URL and endpoint.description == "sync"
    assert endpoint.event_types == ["job.completed", "job.failed"] and endpoint.enabled

    again = owner_a.get("/console/webhooks")
    html = again.content.decode()
    assert endpoint.secret not in html and shown_secret(html) is None
    assert "no-store" not in again.get("Cache-Control", "")
    assert f'id="endpoint-{endpoint.pk}" data-enabled="true"' in html
    assert "job.completed, job.failed" in html


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"url": "http://127.0.0.1:8000/hook"}, "not a public address"),
        ({"url": "http://169.254.169.254/latest"}, "not a public address"),
        ({"url": "ftp://93.184.215.14/x"}, "must be an http:// or https:// URL"),
        ({"url": "http://user:pw@93.184.215.14/x"}, "must not carry credentials"),
        ({"url": "http://93.184.215.14:99999/x"}, "is not a valid URL"),
        ({"url": "http://[::1/x"}, "is not a valid URL"),
        ({"url": "   "}, "This field is required"),
        ({"url": PUBLIC_URL, "event_types": ["job.exploded"]}, "not one of the available"),
        ({"url": PUBLIC_URL, "description": "x" * 513}, "at most 512 characters"),
    ],
)
def test_it_shows_why_an_endpoint_is_refused(owner_a, org_a, body, message):
    response = owner_a.post("/console/webhooks", body)
    assert response.status_code == 200
    html = response.content.decode()
    assert 'class="errorlist' in html and message in html
    assert shown_secret(html) is None
    assert not WebhookEndpoint.objects.exists()


def test_it_lists_deliveries_with_status_http_status_and_next_retry(
    owner_a, org_a, org_b, receiver, settings
):
    settings.WEBHOOK_RETRY_SCHEDULE_S = [3600]  # the next attempt waits (up to an hour)
    endpoint = WebhookEndpoint.objects.register(org_a, receiver.url)
    receiver.script = [(0, 503)]
    failed = delivered(endpoint)
    succeeded = delivered(endpoint, "job.failed")
    retry = WebhookDelivery.objects.get(endpoint=endpoint, event=failed.event, attempt=2)
    theirs = delivered(WebhookEndpoint.objects.register(org_b, receiver.url))

    html = owner_a.get("/console/webhooks").content.decode()

    failed_row = delivery_row(html, failed)
    assert 'data-status="failed"' in failed_row and ">503<" in failed_row
    assert "the endpoint answered 503" in failed_row
    assert failed.next_attempt_at.strftime("%Y-%m-%d %H:%M:%S") in failed_row
    assert "Retry now" in failed_row  # its next attempt is waiting
    succeeded_row = delivery_row(html, succeeded)
    assert 'data-status="succeeded"' in succeeded_row and ">200<" in succeeded_row
    assert "Retry" not in succeeded_row
    pending_row = delivery_row(html, retry)
    assert 'data-status="pending"' in pending_row and 'class="num attempt">2<' in pending_row
    assert theirs.pk not in html and theirs.event.id not in html


def test_retry_requeues_a_failed_delivery(
    owner_a, org_a, receiver, broker, settings, django_capture_on_commit_callbacks
):
    settings.WEBHOOK_MAX_ATTEMPTS = 1
    endpoint = WebhookEndpoint.objects.register(org_a, receiver.url)
    receiver.script = [(0, 500)]
    failed = delivered(endpoint)
    assert (failed.status, failed.next_attempt_at) == ("failed", None)  # it gave up
    assert "Retry<" in delivery_row(owner_a.get("/console/webhooks").content.decode(), failed)

    with django_capture_on_commit_callbacks(execute=True):
        response = owner_a.post(f"/console/webhooks/deliveries/{failed.pk}/retry")
    assert response.status_code == 302 and response["Location"] == "/console/webhooks"

    retry = WebhookDelivery.objects.get(endpoint=endpoint, event=failed.event, attempt=2)
    assert retry.status == "pending" and retry.scheduled_at <= timezone.now()
    assert queued_deliveries(broker) == [retry.pk]
    failed.refresh_from_db()
    assert failed.next_attempt_at == retry.scheduled_at
    # The queued message, run as the worker runs it: sent, signed, logged.
    deliver_webhook(retry.pk)
    retry.refresh_from_db()
    assert (retry.status, retry.response_status_code) == ("succeeded", 200)
    assert [body["id"] for body in receiver.verified(endpoint.secret)] == [failed.event.id] * 2

    # A succeeded later attempt leaves nothing to retry.
    response = owner_a.post(f"/console/webhooks/deliveries/{failed.pk}/retry")
    assert response.status_code == 200 and b"Nothing to retry" in response.content
    assert WebhookDelivery.objects.filter(event=failed.event).count() == 2


def test_retry_now_brings_the_waiting_attempt_forward(
    owner_a, org_a, receiver, broker, django_capture_on_commit_callbacks
):
    endpoint = WebhookEndpoint.objects.register(org_a, receiver.url)
    receiver.script = [(0, 500)]
    failed = delivered(endpoint)
    waiting = WebhookDelivery.objects.get(event=failed.event, attempt=2)
    WebhookDelivery.objects.filter(pk=waiting.pk).update(
        scheduled_at=timezone.now() + timedelta(hours=6)
    )

    with django_capture_on_commit_callbacks(execute=True):
        owner_a.post(f"/console/webhooks/deliveries/{failed.pk}/retry")
    waiting.refresh_from_db()
    assert waiting.status == "pending" and waiting.scheduled_at <= timezone.now()
    assert queued_deliveries(broker) == [waiting.pk]
    assert WebhookDelivery.objects.filter(event=failed.event).count() == 2


def test_it_refuses_to_retry_for_a_disabled_endpoint(owner_a, org_a, receiver):
    endpoint = WebhookEndpoint.objects.register(org_a, receiver.url)
    receiver.script = [(0, 410)]  # Gone: the endpoint is disabled
    failed = delivered(endpoint)
    response = owner_a.post(f"/console/webhooks/deliveries/{failed.pk}/retry")
    assert response.status_code == 200 and b"enable it before retrying" in response.content
    assert WebhookDelivery.objects.filter(event=failed.event).count() == 1


def test_it_disables_enables_and_deletes_an_endpoint(owner_a, org_a):
    endpoint = WebhookEndpoint.objects.create(org=org_a, url=PUBLIC_URL)
    assert owner_a.post(f"/console/webhooks/{endpoint.pk}/disable").status_code == 302
    endpoint.refresh_from_db()
    assert not endpoint.enabled and "alice" in endpoint.disabled_reason
    html = owner_a.get("/console/webhooks").content.decode()
    assert f'id="endpoint-{endpoint.pk}" data-enabled="false"' in html

    assert owner_a.post(f"/console/webhooks/{endpoint.pk}/enable").status_code == 302
    endpoint.refresh_from_db()
    assert endpoint.enabled and endpoint.disabled_reason == ""

    assert owner_a.post(f"/console/webhooks/{endpoint.pk}/delete").status_code == 302
    assert not WebhookEndpoint.objects.exists()
    assert owner_a.get(f"/console/webhooks/{endpoint.pk}/delete").status_code == 405


def test_another_orgs_endpoint_and_deliveries_are_a_404(owner_a, org_b, receiver):
    endpoint = WebhookEndpoint.objects.register(org_b, receiver.url)
    receiver.script = [(0, 500)]
    failed = delivered(endpoint)
    for path in (
        f"/console/webhooks/{endpoint.pk}/disable",
        f"/console/webhooks/{endpoint.pk}/enable",
        f"/console/webhooks/{endpoint.pk}/delete",
        f"/console/webhooks/deliveries/{failed.pk}/retry",
    ):
        assert owner_a.post(path).status_code == 404, path
    endpoint.refresh_from_db()
    assert endpoint.enabled
    assert WebhookDelivery.objects.filter(event=failed.event).count() == 2
    html = owner_a.get("/console/webhooks").content.decode()
    assert endpoint.pk not in html and receiver.url not in html


# Members


def test_it_lists_the_orgs_members_with_role_and_joined(owner_a, org_a, org_b):
    member_of(org_a, "dora", "developer")
    member_of(org_b, "gus", "owner")
    html = owner_a.get("/console/members").content.decode()
    alice, dora = membership(org_a, "alice"), membership(org_a, "dora")
    assert f'id="member-{alice.pk}" data-username="alice" data-role="owner"' in html
    assert f'id="member-{dora.pk}" data-username="dora" data-role="developer"' in html
    assert dora.created.strftime("%Y-%m-%d %H:%M") in html
    assert "gus" not in html


def test_a_billing_viewer_sees_the_list_without_controls(org_a):
    member_of(org_a, "alice", "owner")
    viewer = signed_in(org_a, "bill", "billing")
    html = viewer.get("/console/members").content.decode()
    assert 'data-username="alice"' in html
    assert 'id="invite-member"' not in html and "Change role" not in html


def test_an_admin_invites_an_existing_user(org_a):
    admin = signed_in(org_a, "ada", "admin")
    get_user_model().objects.create(username="dora")
    response = admin.post("/console/members/invite", {"username": "dora", "role": "developer"})
    assert response.status_code == 302 and response["Location"] == "/console/members"
    assert membership(org_a, "dora").role == "developer"


@pytest.mark.parametrize(
    ("username", "role", "message"),
    [
        ("nobody", "developer", "There is no user named “nobody”."),
        ("alice", "developer", "“alice” is already a member of this org."),
        ("dora", "owner", "Only an owner can grant the owner role"),
        ("dora", "emperor", "Select a valid choice"),
        ("", "developer", "This field is required"),
    ],
)
def test_it_explains_a_refused_invitation(org_a, username, role, message):
    member_of(org_a, "alice", "owner")
    admin = signed_in(org_a, "ada", "admin")
    get_user_model().objects.create(username="dora")
    response = admin.post("/console/members/invite", {"username": username, "role": role})
    assert response.status_code == 200
    assert message in response.content.decode()
    assert not Membership.objects.filter(user__username="dora").exists()


def test_an_owner_grants_the_owner_role_and_an_admin_cannot(owner_a, org_a):
    admin = signed_in(org_a, "ada", "admin")
    dora = member_of(org_a, "dora", "developer")

    response = admin.post(f"/console/members/{dora.pk}/role", {"role": "owner"})
    assert response.status_code == 200 and b"Only an owner can grant" in response.content
    assert admin.post(f"/console/members/{dora.pk}/role", {"role": "billing"}).status_code == 302
    dora.refresh_from_db()
    assert dora.role == "billing"

    assert owner_a.post(f"/console/members/{dora.pk}/role", {"role": "owner"}).status_code == 302
    dora.refresh_from_db()
    assert dora.role == "owner"
    # Now an owner: the admin may neither demote nor remove her.
    demoted = admin.post(f"/console/members/{dora.pk}/role", {"role": "admin"})
    removed = admin.post(f"/console/members/{dora.pk}/remove")
    assert b"Only an owner" in demoted.content and b"Only an owner" in removed.content
    dora.refresh_from_db()
    assert dora.role == "owner"


def test_the_last_owner_cannot_step_down(owner_a, org_a):
    alice = membership(org_a, "alice")
    response = owner_a.post(f"/console/members/{alice.pk}/role", {"role": "admin"})
    assert response.status_code == 200
    assert b"must keep at least one owner" in response.content
    alice.refresh_from_db()
    assert alice.role == "owner"

    # With a second owner, either may step down; then the other is the last again.
    olga = member_of(org_a, "olga", "owner")
    assert owner_a.post(f"/console/members/{alice.pk}/role", {"role": "admin"}).status_code == 302
    alice.refresh_from_db()
    assert alice.role == "admin"
    olga_client = Client()
    olga_client.force_login(olga.user)
    response = olga_client.post(f"/console/members/{olga.pk}/role", {"role": "developer"})
    assert b"must keep at least one owner" in response.content


def test_it_removes_a_member_but_not_yourself(owner_a, org_a):
    dora = member_of(org_a, "dora", "developer")
    response = owner_a.post(f"/console/members/{dora.pk}/remove")
    assert response.status_code == 302
    assert not Membership.objects.filter(pk=dora.pk).exists()
    assert get_user_model().objects.filter(username="dora").exists()  # the account stays

    alice = membership(org_a, "alice")
    member_of(org_a, "olga", "owner")
    response = owner_a.post(f"/console/members/{alice.pk}/remove")
    assert b"You cannot remove yourself" in response.content
    assert Membership.objects.filter(pk=alice.pk).exists()


def test_another_orgs_membership_is_a_404(owner_a, org_b):
    theirs = member_of(org_b, "gus", "developer")
    path = f"/console/members/{theirs.pk}"
    assert owner_a.post(f"{path}/role", {"role": "billing"}).status_code == 404
    assert owner_a.post(f"{path}/remove").status_code == 404
    theirs.refresh_from_db()
    assert theirs.role == "developer"


def test_a_developer_may_not_manage_members(org_a):
    developer = signed_in(org_a, "dev", "developer")
    dora = member_of(org_a, "dora", "developer")
    get_user_model().objects.create(username="eve")
    assert developer.post("/console/members/invite", {"username": "eve"}).status_code == 403
    assert developer.post(f"/console/members/{dora.pk}/role", {"role": "admin"}).status_code == 403
    assert developer.post(f"/console/members/{dora.pk}/remove").status_code == 403
    assert set(Membership.objects.filter(org=org_a).values_list("role", flat=True)) == {"developer"}
    assert not Membership.objects.filter(user__username="eve").exists()
