"""Every API error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging

from django.http import JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler

from controlplane.api.auth import MISSING_KEY_MESSAGE

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    402: "insufficient_quota",
    429: "rate_limit_error",
    503: "server_error",
    504: "server_error",
}


class ApiError(Exception):
    """An OpenAI-shaped error raised by the async views, which have no DRF handler around them."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self) -> JsonResponse:
        body = error_body(self.message, self.status, self.param, self.code)
        response = JsonResponse(body, status=self.status)
        for name, value in self.headers.items():
            response[name] = value
        return response


def error_body(message: str, status_code: int, param: str | None = None, code: str | None = None):
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status_code, "server_error"),
            "param": param,
            "code": code,
        }
    }


def _first_validation_error(detail, path: str = "") -> tuple[str | None, str]:
    """(field path, message) of the first error in a DRF ValidationError detail."""
    if isinstance(detail, dict):
        for field, inner in detail.items():
            name = field if field != "non_field_errors" else ""
            return _first_validation_error(inner, f"{path}.{name}".strip(".") if name else path)
    if isinstance(detail, list) and detail:
        return _first_validation_error(detail[0], path)
    return (path or None), str(detail)


def openai_exception_handler(exc, context):
    """DRF's EXCEPTION_HANDLER: OpenAI's error shape for every failure, 500s included."""
    if isinstance(exc, ApiError):  # raised by shared steps (admission) under a DRF view
        return Response(
            error_body(exc.message, exc.status, exc.param, exc.code),
            status=exc.status,
            headers=exc.headers,
        )
    response = exception_handler(exc, context)
    if response is None:
        logger.exception("unhandled error in %s", context.get("view"))
        body = error_body("The server had an error while processing your request.", 500)
        return Response(body, status=status.HTTP_500_INTERNAL_SERVER_ERROR)
    if isinstance(exc, exceptions.ValidationError):
        param, message = _first_validation_error(exc.detail)
        code = "invalid_value"
        response.data = error_body(message, response.status_code, param, code)
        return response
    if isinstance(exc, exceptions.NotAuthenticated):
        response.data = error_body(MISSING_KEY_MESSAGE, 401, code="missing_api_key")
        response.status_code = 401
        return response
    codes = exc.get_codes() if isinstance(exc, exceptions.APIException) else None
    code = codes if isinstance(codes, str) else None
    if isinstance(exc, exceptions.ParseError):
        code = "invalid_json"
    response.data = error_body(str(getattr(exc, "detail", exc)), response.status_code, code=code)
    return response


def not_found(request, exception=None) -> JsonResponse:
    """handler404: unknown URLs answer in the same shape."""
    body = error_body(f"Unknown path {request.path!r}.", 404, code="unknown_url")
    return JsonResponse(body, status=404)


def server_error(request) -> JsonResponse:
    """handler500."""
    return JsonResponse(
        error_body("The server had an error while processing your request.", 500), status=500
    )
