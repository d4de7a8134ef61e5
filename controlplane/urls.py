"""URL routes: the OpenAI-compatible API under /v1, the web console under /console, health under
/healthz. WebSockets (`/ws/events`) are routed in asgi.py."""

from django.urls import include, path
from django.views.generic import RedirectView

from controlplane.gateway.views import healthz

urlpatterns = [
    path("v1/", include("controlplane.gateway.urls")),
    path("console/", include("controlplane.console.urls")),
    path("healthz", healthz),
    path("", RedirectView.as_view(url="/console/", permanent=False)),
]

handler404 = "controlplane.gateway.errors.not_found"
handler500 = "controlplane.gateway.errors.server_error"
