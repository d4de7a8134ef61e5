"""DRF's EXCEPTION_HANDLER: OpenAI's error shape (controlplane/api/errors.py) for every failure of
a DRF view, 500s included. Apart from errors.py because DRF imports this while it loads its views,
which the authentication (auth.py, importing errors.py) must not wait for."""

from __future__ import annotations

import logging

from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler

from controlplane.api.errors import MISSING_KEY_MESSAGE, ApiError, error_answered, error_body

logger = logging.getLogger(__name__)


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
    """DRF's EXCEPTION_HANDLER: OpenAI's error shape for every failure, 500s included; an
    authenticated org's is announced (`error_answered`) for its count."""
    response = _openai_response(exc, context)
    org = _authenticated_org(context.get("request"))
    if org is not None:
        code = response.data["error"]["code"]
        error_answered.send(ApiError, org_id=org.id, status=response.status_code, code=code)
    return response


def _authenticated_org(request):
    """The org of the request's API key; None when it has none (the error may be the key's)."""
    try:
        return getattr(request.user, "org", None) if request is not None else None
    except exceptions.APIException:  # never authenticated: the key is refused again
        return None


def _openai_response(exc, context) -> Response:
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
