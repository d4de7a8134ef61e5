"""OpenAI-compatible endpoints. Views stay thin: fetch, check, call, serialise."""

from __future__ import annotations

from django.http import JsonResponse
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.billing.pricing import decimal_string
from controlplane.catalog.models import ServedModel


def serialize_model(model: ServedModel) -> dict:
    """OpenAI's Model object plus Hearth's `context_length` and `pricing` (USD per 1M tokens,
    as decimal strings: money never passes through a float)."""
    price = model.current_price()
    return {
        "id": model.id,
        "object": "model",
        "created": int(model.created.timestamp()),
        "owned_by": model.owned_by,
        "context_length": model.context_length,
        "pricing": None
        if price is None
        else {
            "input": decimal_string(price.input_per_mtok),
            "cached_input": decimal_string(price.cached_input_per_mtok),
            "output": decimal_string(price.output_per_mtok),
            "unit": "USD per 1M tokens",
            "async_discount_percent": price.async_discount_percent,
        },
    }


class ModelList(APIView):
    def get(self, request: Request) -> Response:
        models = ServedModel.objects.filter(enabled=True).prefetch_related("prices").order_by("id")
        return Response({"object": "list", "data": [serialize_model(m) for m in models]})


class ModelDetail(APIView):
    def get(self, request: Request, model_id: str) -> Response:
        model = ServedModel.objects.filter(id=model_id, enabled=True).first()
        if model is None:
            raise NotFound(f"The model {model_id!r} does not exist.", code="model_not_found")
        return Response(serialize_model(model))


def healthz(request) -> JsonResponse:
    return JsonResponse({"status": "ok"})
