"""The console's webhooks page: the org's endpoints, a new one's signing secret shown once, and
the recent delivery attempts with a Retry for a failed one.

The rules are the API's (controlplane/events/webhooks_api.py): a URL must be http(s) and public
(`check_url`, unless WEBHOOK_ALLOW_PRIVATE), event types are those the control plane emits (none
ticked: every event). Sending is the worker's (`deliver_webhook`): a retry here only makes the
attempt due now (`WebhookDeliveryManager.retry`) and enqueues it once the row is committed; if
the broker is down, the sweep (controlplane/events/redelivery.py) sends it later.
"""

from __future__ import annotations

from functools import partial

from django import forms
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import path
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST

from controlplane.console.roles import console_view
from controlplane.events.tasks import deliver_webhook
from controlplane.events.webhooks import (
    EVENT_TYPES,
    UrlRejected,
    WebhookDelivery,
    WebhookEndpoint,
)

# The page lists this many of the org's newest delivery attempts.
DELIVERIES_SHOWN = 50


class NewEndpointForm(forms.Form):
    """Where to POST the org's events, and which ones."""

    url = forms.CharField(
        max_length=WebhookEndpoint._meta.get_field("url").max_length, strip=True, label="URL"
    )
    event_types = forms.MultipleChoiceField(
        choices=[(name, name) for name in EVENT_TYPES],
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="None ticked: every event.",
    )
    description = forms.CharField(
        max_length=WebhookEndpoint._meta.get_field("description").max_length,
        required=False,
        strip=True,
    )


def page(
    request: HttpRequest,
    form: NewEndpointForm,
    created: WebhookEndpoint | None = None,
    problem: str = "",
) -> HttpResponse:
    """The page: `created` is an endpoint made by this very request (its secret shown, once);
    `problem` says why the action just asked for was refused."""
    endpoints = WebhookEndpoint.objects.filter(org=request.org).order_by("created", "id")
    deliveries = (
        WebhookDelivery.objects.filter(endpoint__org=request.org)
        .select_related("event", "endpoint")
        .order_by("-created", "-attempt")[:DELIVERIES_SHOWN]
    )
    now = timezone.now()
    rows = [
        {
            "delivery": delivery,
            # Failed with nothing to follow (gave up, or the endpoint was disabled): Retry; failed
            # with the next attempt waiting: Retry now.
            "retry": delivery.status == WebhookDelivery.FAILED
            and (delivery.next_attempt_at is None or delivery.next_attempt_at > now),
        }
        for delivery in deliveries
    ]
    context = {
        "form": form,
        "endpoints": endpoints,
        "rows": rows,
        "deliveries_shown": DELIVERIES_SHOWN,
        "created": created,
        "problem": problem,
    }
    response = render(request, "console/webhooks.html", context)
    if created is not None:
        # The one copy of the secret stays out of every cache, the back button's included.
        response["Cache-Control"] = "no-store"
    return response


@require_http_methods(["GET", "POST"])
@console_view("webhooks")
def webhooks(request: HttpRequest) -> HttpResponse:
    """The endpoints and deliveries; POST registers an endpoint and shows its secret in this
    response only (no redirect: the secret must not travel through a URL or the session)."""
    if request.method != "POST":
        return page(request, NewEndpointForm())
    form = NewEndpointForm(request.POST)
    if not form.is_valid():
        return page(request, form)
    try:
        created = WebhookEndpoint.objects.register(
            request.org,
            form.cleaned_data["url"],
            form.cleaned_data["event_types"],
            form.cleaned_data["description"],
        )
    except UrlRejected as exc:
        form.add_error("url", str(exc))
        return page(request, form)
    return page(request, NewEndpointForm(), created=created)


@require_POST
@console_view("webhooks")
def disable_endpoint(request: HttpRequest, endpoint_id: str) -> HttpResponse:
    endpoint = get_object_or_404(WebhookEndpoint, id=endpoint_id, org=request.org)
    endpoint.disable(f"disabled in the console by {request.user.get_username()}")
    return redirect("console:webhooks")


@require_POST
@console_view("webhooks")
def enable_endpoint(request: HttpRequest, endpoint_id: str) -> HttpResponse:
    get_object_or_404(WebhookEndpoint, id=endpoint_id, org=request.org).enable()
    return redirect("console:webhooks")


@require_POST
@console_view("webhooks")
def delete_endpoint(request: HttpRequest, endpoint_id: str) -> HttpResponse:
    """Delete the endpoint and its delivery log, as the API's DELETE does."""
    get_object_or_404(WebhookEndpoint, id=endpoint_id, org=request.org).delete()
    return redirect("console:webhooks")


@require_POST
@console_view("webhooks")
def retry_delivery(request: HttpRequest, delivery_id: str) -> HttpResponse:
    """Send a failed attempt's event again now; the page says why when there is nothing to."""
    failed = get_object_or_404(
        WebhookDelivery.objects.select_related("endpoint"),
        id=delivery_id,
        endpoint__org=request.org,
    )
    if not failed.endpoint.enabled:
        problem = "This endpoint is disabled: enable it before retrying its deliveries."
        return page(request, NewEndpointForm(), problem=problem)
    retry = WebhookDelivery.objects.retry(failed)
    if retry is None:
        problem = (
            "Nothing to retry: this attempt did not fail, or a later one is being sent or "
            "has succeeded."
        )
        return page(request, NewEndpointForm(), problem=problem)
    # robust: the attempt is committed and due; a broker outage leaves it to the sweep.
    transaction.on_commit(partial(deliver_webhook.send, retry.pk), robust=True)
    return redirect("console:webhooks")


urlpatterns = [
    path("webhooks", webhooks, name="webhooks"),
    path("webhooks/<str:endpoint_id>/disable", disable_endpoint, name="disable-webhook"),
    path("webhooks/<str:endpoint_id>/enable", enable_endpoint, name="enable-webhook"),
    path("webhooks/<str:endpoint_id>/delete", delete_endpoint, name="delete-webhook"),
    path(
        "webhooks/deliveries/<str:delivery_id>/retry",
        retry_delivery,
        name="retry-webhook-delivery",
    ),
]
