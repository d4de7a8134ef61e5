"""The API key's authentication, in one place for every API view: `authenticate` turns an
`Authorization: Bearer <api key>` header into the org and key behind it, or the OpenAI-shaped 401.
DRF views get it through `ApiKeyAuthentication` (the default authentication class); the async
views (completions, the event stream, the idempotency wrapper around them), which DRF does not
run, call `authenticate` in the thread they already hop to."""

from __future__ import annotations

from dataclasses import dataclass

from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication

from controlplane.accounts.models import ApiKey, KeyRejected, Org
from controlplane.api.errors import MISSING_KEY_MESSAGE, ApiError


@dataclass
class ApiKeyPrincipal:
    """`request.user` for API calls: the org and key behind the request."""

    org: Org
    api_key: ApiKey
    is_authenticated: bool = True


def bearer_token(header: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None for any other header."""
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def authenticate(header: str) -> ApiKeyPrincipal:
    """The principal behind an `Authorization` header; ApiError 401 (`missing_api_key`,
    `invalid_api_key`, `revoked_api_key`, `expired_api_key`) otherwise. Reads the database on a
    key this process has not seen lately: call it off the event loop."""
    if not header:
        raise ApiError(401, MISSING_KEY_MESSAGE, code="missing_api_key")
    token = bearer_token(header)
    if token is None:
        raise ApiError(
            401,
            "Malformed Authorization header: expected 'Bearer <api key>'.",
            code="invalid_api_key",
        )
    try:
        key = ApiKey.objects.authenticate(token)
    except KeyRejected as rejected:
        raise ApiError(401, str(rejected), code=rejected.code) from None
    return ApiKeyPrincipal(org=key.org, api_key=key)


class ApiKeyAuthentication(BaseAuthentication):
    """DRF's side of `authenticate`: `request.user` is the ApiKeyPrincipal."""

    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header:
            return None  # IsAuthenticated answers 401 "missing_api_key"
        try:
            principal = authenticate(header)
        except ApiError as rejected:
            raise exceptions.AuthenticationFailed(rejected.message, code=rejected.code) from None
        return principal, principal.api_key

    def authenticate_header(self, request) -> str:
        # Makes DRF answer 401 (not 403) to unauthenticated requests.
        return 'Bearer realm="hearth"'
