"""URL routes: the OpenAI-compatible API under /v1, health under /healthz."""

from django.urls import include, path

from controlplane.gateway.views import healthz

urlpatterns = [
    path("v1/", include("controlplane.gateway.urls")),
    path("healthz", healthz),
]

handler404 = "controlplane.gateway.errors.not_found"
handler500 = "controlplane.gateway.errors.server_error"
