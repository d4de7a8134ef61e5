"""DRF authentication by `Authorization: Bearer <api key>`."""

from __future__ import annotations

from dataclasses import dataclass

from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication

from controlplane.accounts.models import ApiKey, KeyRejected, Org


@dataclass
class ApiKeyPrincipal:
    """`request.user` for API calls: the org and key behind the request."""

    org: Org
    api_key: ApiKey
    is_authenticated: bool = True


MISSING_KEY_MESSAGE = "You didn't provide an API key: use 'Authorization: Bearer <api key>'."


def bearer_token(header: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None for any other header."""
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def principal_from_header(header: str) -> ApiKeyPrincipal:
    """The principal behind an `Authorization` header; raises KeyRejected (401) otherwise.

    Shared by the DRF class below and the async completion views, which DRF does not run."""
    if not header:
        raise KeyRejected(MISSING_KEY_MESSAGE, "missing_api_key")
    token = bearer_token(header)
    if token is None:
        raise KeyRejected(
            "Malformed Authorization header: expected 'Bearer <api key>'.", "invalid_api_key"
        )
    key = ApiKey.objects.authenticate(token)
    return ApiKeyPrincipal(org=key.org, api_key=key)


class ApiKeyAuthentication(BaseAuthentication):
    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header:
            return None  # IsAuthenticated answers 401 "missing_api_key"
        try:
            principal = principal_from_header(header)
        except KeyRejected as rejected:
            raise exceptions.AuthenticationFailed(str(rejected), code=rejected.code) from None
        return principal, principal.api_key

    def authenticate_header(self, request) -> str:
        # Makes DRF answer 401 (not 403) to unauthenticated requests.
        return 'Bearer realm="hearth"'
