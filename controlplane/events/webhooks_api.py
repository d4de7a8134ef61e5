"""The webhook endpoints API under /v1/webhook_endpoints.

`POST` registers an endpoint and shows its secret, once; `…/rotate_secret` shows the new one,
once; list and detail never show it. An endpoint of another org is a 404, never a 403.
"""

from __future__ import annotations

from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api.errors import error_body
from controlplane.events.webhooks import (
    EVENT_TYPES,
    UrlRejected,
    WebhookEndpoint,
    delivery_object,
    endpoint_object,
)

DEFAULT_LIMIT, MAX_LIMIT = 20, 100


def _org_endpoint(request: Request, endpoint_id: str) -> WebhookEndpoint:
    endpoint = WebhookEndpoint.objects.filter(id=endpoint_id, org=request.user.org).first()
    if endpoint is None:
        raise NotFound(
            f"No webhook endpoint with id '{endpoint_id}'.", code="webhook_endpoint_not_found"
        )
    return endpoint


def _registration(data) -> tuple[str, list[str], str]:
    """(url, event_types, description) from a request body, or a 400 naming the field."""
    if not isinstance(data, dict):
        raise ValidationError("The request body must be a JSON object.")
    url = data.get("url")
    if not isinstance(url, str) or not url:
        raise ValidationError({"url": ["'url' is required and must be a string."]})
    event_types = data.get("event_types") or []
    if not isinstance(event_types, list) or not all(isinstance(t, str) for t in event_types):
        raise ValidationError({"event_types": ["'event_types' must be a list of strings."]})
    unknown = sorted(set(event_types) - set(EVENT_TYPES))
    if unknown:
        raise ValidationError(
            {"event_types": [f"Unknown event types {unknown}; known: {list(EVENT_TYPES)}."]}
        )
    description = data.get("description") or ""
    if not isinstance(description, str) or len(description) > 512:
        raise ValidationError(
            {"description": ["'description' must be a string of at most 512 characters."]}
        )
    return url, list(dict.fromkeys(event_types)), description


class WebhookEndpointList(APIView):
    """The org's endpoints, oldest first, and registration."""

    def get(self, request: Request) -> Response:
        endpoints = WebhookEndpoint.objects.filter(org=request.user.org).order_by("created", "id")
        return Response({"object": "list", "data": [endpoint_object(e) for e in endpoints]})

    def post(self, request: Request) -> Response:
        url, event_types, description = _registration(request.data)
        try:
            endpoint = WebhookEndpoint.objects.register(
                request.user.org, url, event_types, description
            )
        except UrlRejected as exc:
            return Response(error_body(str(exc), 400, param="url", code=exc.code), status=400)
        return Response(endpoint_object(endpoint, with_secret=True), status=201)


class WebhookEndpointDetail(APIView):
    def get(self, request: Request, endpoint_id: str) -> Response:
        return Response(endpoint_object(_org_endpoint(request, endpoint_id)))

    def delete(self, request: Request, endpoint_id: str) -> Response:
        """Delete the endpoint and its delivery log; attempts not yet sent are dropped."""
        endpoint = _org_endpoint(request, endpoint_id)
        endpoint.delete()
        return Response({"id": endpoint_id, "object": "webhook_endpoint", "deleted": True})


class WebhookEndpointRotateSecret(APIView):
    def post(self, request: Request, endpoint_id: str) -> Response:
        endpoint = _org_endpoint(request, endpoint_id)
        endpoint.rotate_secret()
        return Response(endpoint_object(endpoint, with_secret=True))


class WebhookDeliveryList(APIView):
    """Every attempt to this endpoint, newest first: `limit` (1–100, default 20)."""

    def get(self, request: Request, endpoint_id: str) -> Response:
        endpoint = _org_endpoint(request, endpoint_id)
        raw = request.query_params.get("limit")
        limit = DEFAULT_LIMIT
        if raw is not None:
            if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
                raise ValidationError(
                    {"limit": [f"'limit' must be an integer from 1 to {MAX_LIMIT}."]}
                )
            limit = int(raw)
        deliveries = list(
            endpoint.deliveries.select_related("event").order_by("-created", "-attempt")[
                : limit + 1
            ]
        )
        return Response(
            {
                "object": "list",
                "data": [delivery_object(d) for d in deliveries[:limit]],
                "has_more": len(deliveries) > limit,
            }
        )
