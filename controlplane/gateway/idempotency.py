"""`Idempotency-Key` on POST requests, as Stripe defines it: `@idempotent` for async views.

A request with the header claims the key for its org (the org of its API key) before the view
runs, and then:

- the same key with the same request (method, path, and the body compared by a SHA-256 of its
  canonical JSON, so key order and whitespace do not matter) replays the first response exactly,
  status, body and headers (`x-request-id` …), with `idempotent-replayed: true`;
- the same key with another request is a 409 `idempotency_key_conflict`;
- the same key while the first request is still running is a 409 `idempotency_key_in_use`: the
  request never runs twice.

Client errors (4xx) are kept and replayed like successes, except 401 (no org known), 409 and 429
(transient); 5xx responses, and a view that raises, release the key so a retry runs. Keys last
24 hours (`purge_idempotency_keys` deletes expired rows); keys longer than 255 characters are a
400. A request whose API key is missing or wrong is not scoped to any org: it runs the view,
which answers 401 as it would without the header.

Streamed responses (`stream: true`) cannot be replayed byte for byte, and storing a stream's
chunks would hold the whole answer back. Idempotency covers the request's effect, its job: the
key completes when the view has admitted the request and returns the stream, and a later request
with that key gets a 409 `idempotency_key_replay_unsupported` naming the first request's id
(whose job holds the full completion). It does not run again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable
from functools import wraps

from asgiref.sync import sync_to_async
from django.db import close_old_connections
from django.http import HttpRequest, HttpResponse

from controlplane.api.auth import authenticate
from controlplane.api.errors import ApiError
from controlplane.gateway.models import IdempotencyKey

MAX_KEY_LENGTH = 255
REPLAYED_HEADER = "idempotent-replayed"
# Headers of the first response that are not replayed: the server sets them afresh each time.
_NOT_REPLAYED = frozenset({"content-length", "date", "set-cookie", "vary"})

AsyncView = Callable[..., Awaitable[HttpResponse]]


def request_fingerprint(method: str, path: str, body: bytes) -> str:
    """SHA-256 (hex) of the request a key names. A JSON body is re-dumped with sorted keys and
    no whitespace first, so two encodings of one object match; any other body counts as bytes."""
    try:
        canonical = json.dumps(
            json.loads(body), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        ).encode()
    except (ValueError, UnicodeDecodeError):
        canonical = body
    digest = hashlib.sha256(f"{method.upper()} {path}\n".encode())
    digest.update(canonical)
    return digest.hexdigest()


def idempotent(view: AsyncView) -> AsyncView:
    """Honour `Idempotency-Key` on POST requests to an async view; see the module docstring."""

    @wraps(view)
    async def idempotent_view(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        key = request.headers.get("Idempotency-Key")
        if key is None or request.method != "POST":
            return await view(request, *args, **kwargs)
        fingerprint = request_fingerprint(request.method, request.path, request.body)
        claim = await _off_loop(
            _claim,
            request.headers.get("Authorization", ""),
            key,
            fingerprint,
            request.method,
            request.path,
        )
        if isinstance(claim, HttpResponse):
            return claim
        try:
            response = await view(request, *args, **kwargs)
        except Exception:
            await _off_loop(claim.release)
            raise
        body = None if response.streaming else response.content
        headers = {
            name: value for name, value in response.items() if name.lower() not in _NOT_REPLAYED
        }
        await _off_loop(claim.settle, response.status_code, headers, body)
        return response

    return idempotent_view


def _claim(
    authorization: str, key: str, fingerprint: str, method: str, path: str
) -> IdempotencyKey | HttpResponse:
    """This request's claim on the key, to run the view under; or the response to give instead
    (a replay, an error, or the key's 401)."""
    try:
        return _claim_for_org(authenticate(authorization).org, key, fingerprint, method, path)
    except ApiError as error:
        return error.response()


def _claim_for_org(
    org, key: str, fingerprint: str, method: str, path: str
) -> IdempotencyKey | HttpResponse:
    if not key or len(key) > MAX_KEY_LENGTH:
        raise ApiError(
            400,
            f"The Idempotency-Key header must be 1 to {MAX_KEY_LENGTH} characters long; this "
            f"one has {len(key)}.",
            param="Idempotency-Key",
            code="invalid_idempotency_key",
        )
    row, claimed = IdempotencyKey.objects.claim(org, key, fingerprint, method, path)
    if claimed:
        return row
    if row.fingerprint != fingerprint:
        raise ApiError(
            409,
            f"The Idempotency-Key {key!r} was used in the last 24 hours for a different request "
            f"(to {row.method} {row.path}); use a new key for a new request.",
            code="idempotency_key_conflict",
        )
    if row.state == IdempotencyKey.IN_FLIGHT:
        raise ApiError(
            409,
            f"A request with the Idempotency-Key {key!r} is still being processed; retry after "
            "it has finished to get its response.",
            code="idempotency_key_in_use",
            headers={"retry-after": "1"},
        )
    if not row.replayable:
        request_id = row.response_headers.get("x-request-id", "")
        raise ApiError(
            409,
            f"The request with the Idempotency-Key {key!r} streamed its response, which cannot "
            f"be replayed; it ran as request {request_id!r}. Use a new key to run it again.",
            code="idempotency_key_replay_unsupported",
        )
    return _replay(row)


def _replay(row: IdempotencyKey) -> HttpResponse:
    """The first response to the key's request, again: status, body and headers."""
    response = HttpResponse(bytes(row.response_body), status=row.response_status)
    for name, value in row.response_headers.items():
        response[name] = value
    response[REPLAYED_HEADER] = "true"
    return response


async def _off_loop(function, *args):
    """Run an ORM function in a worker thread, as admission does, handing its connection back."""

    def run():
        try:
            return function(*args)
        finally:
            close_old_connections()

    return await sync_to_async(run, thread_sensitive=False)()
