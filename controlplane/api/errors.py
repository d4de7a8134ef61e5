"""Every API error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

DRF's views reach it through controlplane/api/exception_handler.py."""

from __future__ import annotations

from django.dispatch import Signal
from django.http import JsonResponse

MISSING_KEY_MESSAGE = "You didn't provide an API key: use 'Authorization: Bearer <api key>'."

# Sent with `org_id`, `status` and `code` when an error is answered to an authenticated org's
# request; the gateway counts them for the console's dashboard (gateway/models.py ApiErrorCount).
error_answered = Signal()

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


def not_found(request, exception=None) -> JsonResponse:
    """handler404: unknown URLs answer in the same shape."""
    body = error_body(f"Unknown path {request.path!r}.", 404, code="unknown_url")
    return JsonResponse(body, status=404)


def server_error(request) -> JsonResponse:
    """handler500."""
    return JsonResponse(
        error_body("The server had an error while processing your request.", 500), status=500
    )
