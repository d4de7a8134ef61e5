"""Routes of the event log's API under /v1: the event stream and webhook endpoints."""

from django.urls import path

from controlplane.events import stream, webhooks_api

urlpatterns = [
    path("events", stream.events),
    path("webhook_endpoints", webhooks_api.WebhookEndpointList.as_view()),
    path("webhook_endpoints/<str:endpoint_id>", webhooks_api.WebhookEndpointDetail.as_view()),
    path(
        "webhook_endpoints/<str:endpoint_id>/rotate_secret",
        webhooks_api.WebhookEndpointRotateSecret.as_view(),
    ),
    path(
        "webhook_endpoints/<str:endpoint_id>/deliveries",
        webhooks_api.WebhookDeliveryList.as_view(),
    ),
]
