"""Rate limits at admission: a key's requests and tokens per minute (controlplane/billing/
ratelimit.py holds the buckets).

A completion request costs 1 request and its prompt tokens plus `max_tokens` (as OpenAI counts
it: the most it may use), taken before the job exists, so a refused request writes nothing. Its
response carries OpenAI's `x-ratelimit-*` headers whenever its key has a limit. Buckets live in
Redis in production (shared by every gateway process, atomic in one Lua script) and in memory in
embedded mode. Batch lines are not rate limited: a batch is the way to send much at once.
"""

from __future__ import annotations

import threading

from django.conf import settings

from controlplane.accounts.models import ApiKey
from controlplane.api.errors import ApiError
from controlplane.billing.ratelimit import (
    Limits,
    MemoryRateLimiter,
    RateLimiter,
    RedisRateLimiter,
)

_lock = threading.Lock()
_limiter: RateLimiter | None = None


def limiter() -> RateLimiter:
    """This process's limiter: Redis's buckets (production) or its own (embedded)."""
    global _limiter
    with _lock:
        if _limiter is None:
            if settings.EMBEDDED:
                _limiter = MemoryRateLimiter()
            else:
                import redis

                _limiter = RedisRateLimiter(
                    redis.Redis.from_url(settings.REDIS_URL), prefix=settings.RATE_LIMIT_PREFIX
                )
        return _limiter


def take_rate_limit(api_key: ApiKey, tokens: int) -> dict[str, str]:
    """Take one request and `tokens` from the key's buckets; the response headers, or ApiError
    429 `rate_limit_exceeded` (with the same headers and `retry-after`)."""
    limits = Limits(api_key.requests_per_minute, api_key.tokens_per_minute)
    if limits.requests_per_minute is None and limits.tokens_per_minute is None:
        return {}
    decision = limiter().take(str(api_key.pk), limits, tokens)
    if decision.allowed:
        return decision.headers()
    if decision.too_large:
        message = (
            f"Request too large: it may use {tokens} tokens (prompt plus max_tokens), more than "
            f"this key's limit of {limits.tokens_per_minute} tokens per minute. Lower max_tokens "
            "or shorten the prompt."
        )
    else:
        unit = "requests" if decision.refused_by == "requests" else "tokens"
        limit = limits.requests_per_minute if unit == "requests" else limits.tokens_per_minute
        message = (
            f"Rate limit reached: this key may use {limit} {unit} per minute. Try again in "
            f"{decision.headers().get('retry-after', '?')} s."
        )
    raise ApiError(429, message, code="rate_limit_exceeded", headers=decision.headers())
