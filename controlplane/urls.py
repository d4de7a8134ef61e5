"""URL routes: the OpenAI-compatible API under /v1, the web console under /console, health under
/healthz, Prometheus metrics under /metrics, the API's OpenAPI document at /openapi.json.
WebSockets (`/ws/events`) are routed in asgi.py."""

from django.urls import include, path
from django.views.generic import RedirectView

from controlplane.gateway.metrics import metrics
from controlplane.gateway.views import healthz
from controlplane.openapi.views import OpenApiDocument

urlpatterns = [
    path("v1/", include("controlplane.gateway.urls")),
    path("console/", include("controlplane.console.urls")),
    path("healthz", healthz),
    path("openapi.json", OpenApiDocument.as_view()),
    path("metrics", metrics),
    path("", RedirectView.as_view(url="/console/", permanent=False)),
]

handler404 = "controlplane.api.errors.not_found"
handler500 = "controlplane.api.errors.server_error"
