"""The console's playground: chat with a served model from the browser, through the API's own
admission path, and see what each turn cost and where it ran.

The page's script posts an OpenAI chat request (JSON, with the session cookie and the CSRF token)
to `playground/chat`, which admits it exactly as `POST /v1/chat/completions` would
(gateway/completions.py: validation, budgets, rate limits, routing, the Job row, billing) and
answers the same SSE stream. The session acts through an API key of its org, "Console playground",
made on first use: the console holds the key's row, never its secret, which nobody ever sees. The
key is listed on the API keys page like any other, so its spend and limits are visible there; it
may be revoked, and the next turn then makes a fresh one.

After a stream ends, the script reads `playground/turns/<request id>`: the job's node, timings and
the cost its usage row was charged, once the worker has settled it.
"""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.db import transaction
from django.db.models import Q
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, render
from django.urls import path, reverse
from django.utils import timezone
from django.views.decorators.http import require_GET

from controlplane.accounts.models import ApiKey, Org
from controlplane.api.auth import ApiKeyPrincipal
from controlplane.billing.pricing import decimal_string
from controlplane.catalog.models import ServedModel
from controlplane.catalog.registry import every_live_node
from controlplane.console.roles import console_view
from controlplane.gateway.completions import chat_completions_as
from controlplane.jobs.models import Job
from controlplane.jobs.serializers import job_object

CONSOLE_KEY_NAME = "Console playground"
# What the page reads of a turn's job, as the API's job object has it (not the response: the page
# has that from the stream).
TURN_FIELDS = (
    "id",
    "request_id",
    "status",
    "model",
    "node",
    "prefill_node",
    "usage",
    "cost",
    "error",
)


def console_key(org: Org) -> ApiKey:
    """The org's active "Console playground" key, made on first use. Its secret is discarded at
    once: the playground admits with the key's row (`chat_completions_as`), never a token."""
    key = _active_console_key(org)
    if key is None:
        with transaction.atomic():
            # Two first turns at once would each make a key: the org's row lock orders them, and
            # the second finds the first's key.
            Org.objects.select_for_update().filter(pk=org.pk).first()
            key = _active_console_key(org)
            if key is None:
                key, _ = ApiKey.objects.create_key(org, CONSOLE_KEY_NAME)
    key.org = org
    key.touch()  # the keys page shows when it was last used, as for a key sent as a token
    return key


def _active_console_key(org: Org) -> ApiKey | None:
    unexpired = Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now())
    keys = ApiKey.objects.filter(unexpired, org=org, name=CONSOLE_KEY_NAME, revoked_at=None)
    return keys.order_by("created").first()


def served_models() -> list[dict]:
    """The catalog's enabled models, each with its price now and how many nodes serve it."""
    nodes_by_model: dict[str, int] = {}
    for state in every_live_node():
        nodes_by_model[state.get("model")] = nodes_by_model.get(state.get("model"), 0) + 1
    models = []
    for model in ServedModel.objects.filter(enabled=True).order_by("id"):
        price = model.current_price()
        models.append(
            {
                "id": model.id,
                "context_length": model.context_length,
                "nodes": nodes_by_model.get(model.id, 0),
                "price": None
                if price is None
                else {
                    "input": decimal_string(price.input_per_mtok),
                    "cached_input": decimal_string(price.cached_input_per_mtok),
                    "output": decimal_string(price.output_per_mtok),
                },
            }
        )
    return models


@require_GET
@console_view("playground")
def playground(request: HttpRequest) -> HttpResponse:
    """The playground page: the models to pick from and the key its turns run under."""
    context = {
        "models": served_models(),
        "console_key": _active_console_key(request.org),
        "console_key_name": CONSOLE_KEY_NAME,
    }
    return render(request, "console/playground.html", context)


@console_view("playground")
def _acting_principal(request: HttpRequest) -> ApiKeyPrincipal:
    # Behind console_view, which answers instead (the sign-in redirect, the role's 403 page)
    # when the session may not use the playground.
    key = console_key(request.org)
    return ApiKeyPrincipal(org=key.org, api_key=key)


async def chat(request: HttpRequest) -> HttpResponse:
    """`POST /v1/chat/completions` for a console session, under its org's console key: the same
    admission, answer and SSE stream as the API's, errors in OpenAI's shape. The CSRF middleware
    checks the page's token first (this view is not exempt, as the API's views are)."""
    acting = await sync_to_async(_acting_principal)(request)
    if isinstance(acting, HttpResponse):
        return acting
    return await chat_completions_as(request, acting)


@require_GET
@console_view("playground")
def turn(request: HttpRequest, request_id: str) -> JsonResponse:
    """One turn's job, by its request id (another org's is a 404): its status, node, usage and
    the cost its usage row was charged, with the node's timings."""
    job = get_object_or_404(Job, request_id=request_id, org=request.org)
    shown = job_object(job)
    body = {name: shown[name] for name in TURN_FIELDS}
    body.update(
        ttft_s=job.ttft_s,
        tpot_s=job.tpot_s,
        e2e_s=job.e2e_s,
        settled=job.status in Job.TERMINAL,
        url=reverse("console:job", args=[job.id]),
    )
    return JsonResponse(body)


urlpatterns = [
    path("playground", playground, name="playground"),
    path("playground/chat", chat, name="playground-chat"),
    path("playground/turns/<str:request_id>", turn, name="playground-turn"),
]
