"""`GET /metrics`: the registry of controlplane/metrics.py in Prometheus's exposition format,
with the gateway's own request series (gateway/request_metrics.py). In embedded mode the worker's
and the nodes' series are registered in it too (controlplane/embedded.py); in production they are
served by the worker and each node (docs/observability.md)."""

from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpResponse
from prometheus_client.exposition import choose_encoder

from controlplane.api.auth import bearer_token
from controlplane.api.errors import ApiError
from controlplane.gateway import request_metrics
from controlplane.metrics import REGISTRY, SharedCollector

REGISTRY.register(SharedCollector(request_metrics.FAMILIES))


def metrics(request) -> HttpResponse:
    """`GET /metrics`: for the operator's Prometheus. It names models and counts tokens of every
    org: with HEARTH_METRICS_TOKEN set it answers only that bearer token (401 otherwise);
    without, keep it off the public network (like the admin). The format follows the Accept
    header as prometheus_client's own server does: the text format unless OpenMetrics is asked."""
    if settings.METRICS_TOKEN:
        sent = bearer_token(request.headers.get("Authorization", "")) or ""
        if not hmac.compare_digest(sent.encode(), settings.METRICS_TOKEN.encode()):
            return ApiError(
                401, "GET /metrics needs the metrics token as a bearer token.", code="invalid_token"
            ).response()
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encode(REGISTRY), content_type=content_type)
