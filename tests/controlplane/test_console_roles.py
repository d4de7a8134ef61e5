"""Every console route, for each of the four roles and across two orgs, read from the URL patterns
at run time: a page added later is covered as soon as it exists, and until `CALLS` says how to
call it, its test fails.

For each route and role: the response is allowed (2xx or 3xx) exactly when the role holds the
route's permission (console/roles.py), else the 403 page. For each route that takes an object
id: another org's object is a 404 for every role that may use the route, and for a role that may
not, the same 403 a made-up id gets; either way the object's table is left as it was.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date, timedelta
from typing import Any

import dramatiq
import pytest
from django.contrib.auth import get_user_model
from django.db.models import Model
from django.test import Client
from django.urls import URLPattern, reverse
from django.utils import timezone

from controlplane.accounts.models import ApiKey, Membership, Org
from controlplane.billing.invoices import Invoice
from controlplane.console import urls as console_urls
from controlplane.console.roles import PERMISSIONS
from controlplane.events.models import Event
from controlplane.events.webhooks import WebhookDelivery, WebhookEndpoint
from controlplane.jobs.batches import Batch
from controlplane.jobs.files import File
from controlplane.jobs.models import Job

ROLES = [value for value, _ in Membership.ROLES]
NOT_CONSOLE_PAGES = {"login", "logout"}  # Django's auth views: no org, no role
PUBLIC_ADDRESS = "93.184.215.14"  # an IP literal: registering it needs no DNS
user_numbers = itertools.count()  # unique user names and invoice months


def new_user(username: str = ""):
    """A user without a usable password (force_login needs none; hashing one is slow)."""
    return get_user_model().objects.create(username=username or f"user-{next(user_numbers)}")


# How to make an object of an org for each kind of id a route takes, by the route's parameter.


def make_key(org: Org) -> Model:
    return ApiKey.objects.create_key(org, "matrix")[0]


def make_job(org: Org) -> Model:
    return Job.objects.create(
        org=org, model="tiny", request={"messages": []}, prompt_token_ids=[1, 2, 3]
    )


def make_file(org: Org) -> Model:
    content = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
    return File.objects.create(
        org=org, filename="in.jsonl", purpose=File.BATCH, bytes=len(content), content=content
    )


def make_batch(org: Org) -> Model:
    return Batch.objects.create(
        org=org,
        endpoint="/v1/chat/completions",
        model="tiny",
        input_file_id=make_file(org).pk,
        completion_window="24h",
        status=Batch.IN_PROGRESS,
        total=1,
        expires_at=timezone.now() + timedelta(days=1),
    )


def make_invoice(org: Org) -> Model:
    """A draft invoice of a month of its own (one per org and month)."""
    number = next(user_numbers)
    return Invoice.objects.create(
        org=org, period_start=date(2000 + number // 12, number % 12 + 1, 1)
    )


def make_endpoint(org: Org) -> Model:
    return WebhookEndpoint.objects.create(org=org, url=f"https://{PUBLIC_ADDRESS}/hooks")


def make_failed_delivery(org: Org) -> Model:
    event = Event.objects.create(org=org, type="job.completed", data={"id": "job_x"})
    return WebhookDelivery.objects.create(
        endpoint=make_endpoint(org),
        event=event,
        attempt=1,
        status=WebhookDelivery.FAILED,
        response_status_code=500,
        scheduled_at=timezone.now(),
    )


def make_member(org: Org) -> Model:
    return Membership.objects.create(org=org, user=new_user(), role="developer")


# A route parameter: the object to make, and the field of it the parameter names.
OBJECTS: dict[str, tuple[Callable[[Org], Model], str]] = {
    "key_id": (make_key, "pk"),
    "job_id": (make_job, "pk"),
    "request_id": (make_job, "request_id"),
    "batch_id": (make_batch, "pk"),
    "file_id": (make_file, "pk"),
    "invoice_id": (make_invoice, "pk"),
    "endpoint_id": (make_endpoint, "pk"),
    "delivery_id": (make_failed_delivery, "pk"),
    "membership_id": (make_member, "pk"),
}


def invitation(org: Org) -> dict[str, str]:
    return {"username": new_user().username}


@dataclass(frozen=True)
class Call:
    """One way to call a route: its method, the permission it needs, and its body (a dict, or a
    function of the caller's org returning one). `allowed` is the status a role holding the
    permission gets when it is not any 2xx or 3xx (an API error in OpenAI's shape, say, that
    only a caller past the role check can get)."""

    permission: str
    method: str = "get"
    data: dict[str, Any] | Callable[[Org], dict[str, Any]] = field(default_factory=dict)
    allowed: int | None = None

    def body(self, org: Org) -> dict[str, Any]:
        return self.data(org) if callable(self.data) else self.data

    def allows(self, status: int) -> bool:
        return status == self.allowed if self.allowed else 200 <= status < 400


def make(parameter: str, org: Org) -> tuple[Model, Any]:
    """A new object of `org` for the route parameter, and the parameter's value for it."""
    assert parameter in OBJECTS, f"no object maker in OBJECTS for the route parameter {parameter!r}"
    maker, id_field = OBJECTS[parameter]
    made = maker(org)
    return made, getattr(made, id_field)


# Every console route by name: how to call it. A route missing here fails its test.
CALLS: dict[str, list[Call]] = {
    "overview": [Call("dashboard")],
    "keys": [Call("keys"), Call("keys", "post", {"name": "matrix"})],
    "revoke-key": [Call("keys", "post")],
    "jobs": [Call("jobs")],
    "job": [Call("jobs")],
    "cancel-job": [Call("cancel_job", "post")],
    "batches": [Call("batches")],
    "batch": [Call("batches")],
    "file-content": [Call("batches")],
    "playground": [Call("playground")],
    # A GET: the API's 405 in OpenAI's shape, which only a caller past the role check gets (a
    # POST is admitted on another thread, which cannot see this test's uncommitted rows).
    "playground-chat": [Call("playground", allowed=405)],
    "playground-turn": [Call("playground")],
    "fleet": [Call("fleet")],
    "fleet-json": [Call("fleet")],
    "billing": [Call("billing")],
    "usage-csv": [Call("billing")],
    "invoice": [Call("billing")],
    "webhooks": [
        Call("webhooks"),
        Call("webhooks", "post", {"url": f"https://{PUBLIC_ADDRESS}/hooks"}),
    ],
    "disable-webhook": [Call("webhooks", "post")],
    "enable-webhook": [Call("webhooks", "post")],
    "delete-webhook": [Call("webhooks", "post")],
    "retry-webhook-delivery": [Call("webhooks", "post")],
    "members": [Call("members")],
    "invite-member": [Call("manage_members", "post", invitation)],
    "member-role": [Call("manage_members", "post", {"role": "billing"})],
    "remove-member": [Call("manage_members", "post")],
}


def console_routes() -> list[URLPattern]:
    return [p for p in console_urls.urlpatterns if p.name not in NOT_CONSOLE_PAGES]


def route_id(route: URLPattern) -> str:
    return route.name or str(route.pattern)


def parameters(route: URLPattern) -> list[str]:
    return list(route.pattern.converters)


def made_up_id(route: URLPattern, parameter: str) -> Any:
    converter = route.pattern.converters[parameter]
    return 987654321 if converter.regex == "[0-9]+" else "nonexistent_000"


@pytest.fixture(autouse=True)
def broker_left_clean():
    """Actions enqueue work (a job's cancel, ...): drop it, no worker runs here."""
    yield
    dramatiq.get_broker().flush_all()


@pytest.fixture
def orgs(db) -> tuple[Org, Org]:
    return Org.objects.create(slug="acme", name="Acme"), Org.objects.create(
        slug="globex", name="Globex"
    )


@pytest.fixture
def clients(orgs) -> dict[str, Client]:
    """A signed-in client per role, each a member of org A (Acme) only."""
    org_a, _ = orgs
    by_role = {}
    for role in ROLES:
        Membership.objects.create(org=org_a, user=new_user(f"acme-{role}"), role=role)
        by_role[role] = Client()
        by_role[role].force_login(get_user_model().objects.get(username=f"acme-{role}"))
    return by_role


def send(client: Client, call: Call, path: str, org: Org):
    body = call.body(org)
    return client.post(path, body) if call.method == "post" else client.get(path, body)


def table_rows(model: type[Model]) -> list[dict]:
    return list(model.objects.order_by("pk").values())


@pytest.mark.parametrize("route", console_routes(), ids=route_id)
def test_each_role_gets_exactly_what_its_permissions_allow(route, orgs, clients):
    assert route.name in CALLS, (
        f"console:{route.name} ({route.pattern}) has no entry in CALLS: say how to call it "
        "and which permission it needs"
    )
    org_a, _ = orgs
    wrong = []
    for call in CALLS[route.name]:
        assert call.permission in PERMISSIONS, call
        for role, client in clients.items():
            # Fresh objects for each call: an action may have deleted the last one's.
            kwargs = {p: make(p, org_a)[1] for p in parameters(route)}
            response = send(client, call, reverse(f"console:{route.name}", kwargs=kwargs), org_a)
            allowed = role in PERMISSIONS[call.permission]
            ok = call.allows(response.status_code) if allowed else response.status_code == 403
            if not ok:
                wrong.append(f"{call.method.upper()} as {role}: {response.status_code}")
            if not allowed:
                assert b'id="forbidden"' in response.content
    assert not wrong, f"console:{route.name} ({route.pattern}): {wrong}"


OBJECT_ROUTES = [route for route in console_routes() if parameters(route)]


@pytest.mark.parametrize("route", OBJECT_ROUTES, ids=route_id)
def test_another_orgs_object_is_not_found_for_every_role(route, orgs, clients):
    assert route.name in CALLS, f"console:{route.name} ({route.pattern}) has no entry in CALLS"
    org_a, org_b = orgs
    wrong = []
    for call in CALLS[route.name]:
        for role, client in clients.items():
            theirs = {p: make(p, org_b) for p in parameters(route)}
            before = {p: table_rows(type(obj)) for p, (obj, _) in theirs.items()}
            kwargs = {p: value for p, (_, value) in theirs.items()}
            response = send(client, call, reverse(f"console:{route.name}", kwargs=kwargs), org_a)
            made_up = {p: made_up_id(route, p) for p in parameters(route)}
            missing = send(client, call, reverse(f"console:{route.name}", kwargs=made_up), org_a)
            expected = 404 if role in PERMISSIONS[call.permission] else 403
            if (response.status_code, missing.status_code) != (expected, expected):
                wrong.append(
                    f"{call.method.upper()} as {role}: {response.status_code} for another "
                    f"org's object, {missing.status_code} for none (expected {expected})"
                )
            for parameter, (obj, _) in theirs.items():
                assert table_rows(type(obj)) == before[parameter], (
                    f"console:{route.name} as {role} changed another org's {parameter}"
                )
    assert not wrong, f"console:{route.name} ({route.pattern}): {wrong}"


def test_every_route_needs_a_signed_in_user(orgs):
    anonymous = Client()
    for route in console_routes():
        kwargs = {p: made_up_id(route, p) for p in parameters(route)}
        path = reverse(f"console:{route.name}", kwargs=kwargs)
        for call in CALLS.get(route.name, []):  # a route missing there fails the tests above
            response = send(anonymous, call, path, orgs[0])
            assert response.status_code == 302, (route.name, call.method)
            assert response["Location"].startswith("/console/login?next=")


# The named checks.


def test_a_billing_viewer_cannot_create_keys(orgs, clients):
    org_a, _ = orgs
    response = clients["billing"].post(reverse("console:keys"), {"name": "sneaky"})
    assert response.status_code == 403
    assert b"Billing viewer" in response.content
    assert not ApiKey.objects.filter(org=org_a).exists()
    # Nor is the page offered: the nav has no link to it.
    nav = clients["billing"].get(reverse("console:members")).content.decode()
    assert reverse("console:keys") not in nav and "API keys" not in nav


def test_a_developer_cannot_see_invoices(orgs, clients):
    org_a, _ = orgs
    invoice = make_invoice(org_a)
    developer = clients["developer"]
    for path in (
        reverse("console:billing"),
        reverse("console:invoice", kwargs={"invoice_id": invoice.pk}),
    ):
        response = developer.get(path)
        assert response.status_code == 403
        assert b"Developer" in response.content and invoice.pk.encode() not in response.content
    assert clients["billing"].get(reverse("console:billing")).status_code == 200
