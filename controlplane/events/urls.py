"""Routes of the event log's API under /v1: the event stream and webhook endpoints."""

urlpatterns: list = []
