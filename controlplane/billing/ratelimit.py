"""Per-key rate limits: requests per minute and tokens per minute, as token buckets.

Each key has two buckets. A bucket's capacity is its per-minute limit, and it refills
continuously at limit/60 per second up to that capacity; a key never seen (or idle long
enough to have refilled) has full buckets. A request takes 1 from the request bucket and
`tokens` (the caller's estimate: prompt tokens + max_tokens) from the token bucket, both or
neither: a refused request consumes nothing. A request costing more tokens than the whole
token capacity can never pass and is refused with `too_large` set, so the caller can say so
rather than ask the client to wait. After completion, `refund` gives back what the estimate
took beyond actual usage, never filling a bucket above its capacity. A limit of None means
unlimited: that bucket does not exist and its headers are omitted.

`RedisRateLimiter` keeps the buckets in Redis and does read-refill-check-take for both in one
Lua script, so concurrent gateways cannot both spend the last slot, and it reads Redis's own
clock, so the gateways' clocks do not matter. `MemoryRateLimiter` does the same in-process
under a lock, for embedded mode. The Lua script repeats `_refill` and the fit check of
`MemoryRateLimiter._apply`; the tests run both on the same sequences.

The headers are OpenAI's: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, where
remaining is the whole units in the bucket after the decision and reset is the time until
the bucket is full again, written as OpenAI writes durations ("120ms", "1.5s", "6m0s").
"""

from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import redis

Dimension = Literal["requests", "tokens"]


@dataclass(frozen=True)
class Limits:
    """A key's limits; None is unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, not {value!r}")


@dataclass(frozen=True)
class BucketReading:
    """One bucket just after a decision, as the headers report it."""

    limit: int
    remaining: int  # whole units left
    reset_s: float  # until the bucket is full again


@dataclass(frozen=True)
class Decision:
    """Whether a request may run, and the rate-limit headers for its response."""

    allowed: bool
    refused_by: Dimension | None  # the bucket that was short, None when allowed
    too_large: bool  # the token cost exceeds the whole tokens-per-minute limit
    requests: BucketReading | None  # None when unlimited
    tokens: BucketReading | None
    retry_after_s: float | None  # until both buckets hold enough; None if allowed or too large

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers, plus `retry-after` in whole seconds when refused."""
        headers = {}
        for dimension, reading in (("requests", self.requests), ("tokens", self.tokens)):
            if reading is not None:
                headers[f"x-ratelimit-limit-{dimension}"] = str(reading.limit)
                headers[f"x-ratelimit-remaining-{dimension}"] = str(reading.remaining)
                headers[f"x-ratelimit-reset-{dimension}"] = format_duration(reading.reset_s)
        if self.retry_after_s is not None:
            headers["retry-after"] = str(math.ceil(self.retry_after_s))
        return headers


def format_duration(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it (Go's format), rounded up to the
    millisecond: "0s", "120ms", "1.5s", "59.99s", "6m0s", "1h0m0s"."""
    # Rounding to the microsecond first keeps 0.3 s at 300 ms, not 301 from float error.
    millis = math.ceil(round(seconds * 1000, 3))
    if millis <= 0:
        return "0s"
    if millis < 1000:
        return f"{millis}ms"
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    whole_seconds, millis = divmod(rest, 1000)
    text = f"{whole_seconds}.{millis:03d}".rstrip("0") if millis else str(whole_seconds)
    if hours:
        return f"{hours}h{minutes}m{text}s"
    if minutes:
        return f"{minutes}m{text}s"
    return f"{text}s"


def _refill(level: float, elapsed_s: float, capacity: int) -> float:
    # max(): a clock that steps back (a Redis failover) must not drain the bucket.
    return min(capacity, level + max(0.0, elapsed_s) * capacity / 60)


def _reading(capacity: int, level: float) -> BucketReading:
    return BucketReading(
        limit=capacity,
        remaining=math.floor(level),
        reset_s=(capacity - level) * 60 / capacity,
    )


def _decide(
    limits: Limits, tokens: int, allowed: bool, request_level: float, token_level: float
) -> Decision:
    """The decision from the buckets' levels after the check (and the take, when allowed)."""
    requests = tokens_reading = None
    waits: dict[Dimension, float] = {}
    if limits.requests_per_minute is not None:
        requests = _reading(limits.requests_per_minute, request_level)
        if not allowed and request_level < 1:
            waits["requests"] = (1 - request_level) * 60 / limits.requests_per_minute
    too_large = False
    if limits.tokens_per_minute is not None:
        tokens_reading = _reading(limits.tokens_per_minute, token_level)
        too_large = tokens > limits.tokens_per_minute
        if not allowed and token_level < tokens:
            waits["tokens"] = (tokens - token_level) * 60 / limits.tokens_per_minute
    if allowed:
        refused_by, retry_after_s = None, None
    elif too_large:
        refused_by, retry_after_s = "tokens", None
    else:
        refused_by = max(waits, key=waits.__getitem__)
        retry_after_s = max(waits.values())
    return Decision(allowed, refused_by, too_large, requests, tokens_reading, retry_after_s)


def _check_tokens(tokens: int) -> None:
    if not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"tokens must be a non-negative integer, not {tokens!r}")


class RateLimiter(ABC):
    """What both limiters offer; `_apply` is where they keep the buckets."""

    def take(self, key_id: str, limits: Limits, tokens: int) -> Decision:
        """Take one request and `tokens` tokens from the key's buckets, or nothing."""
        _check_tokens(tokens)
        allowed, request_level, token_level = self._apply(key_id, limits, 1, tokens)
        return _decide(limits, tokens, allowed, request_level, token_level)

    def refund(self, key_id: str, limits: Limits, tokens: int) -> None:
        """Give back `tokens` the estimate took beyond actual usage, up to the capacity."""
        _check_tokens(tokens)
        self._apply(key_id, Limits(tokens_per_minute=limits.tokens_per_minute), 0, -tokens)

    @abstractmethod
    def _apply(
        self, key_id: str, limits: Limits, request_cost: int, token_cost: int
    ) -> tuple[bool, float, float]:
        """Refill both buckets, and take both costs if both fit (a negative cost is a refund).
        Returns whether they fit and the levels after, 0.0 for an unlimited bucket."""


class MemoryRateLimiter(RateLimiter):
    """The token buckets in this process (embedded mode), on the monotonic clock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, Dimension], tuple[float, float]] = {}  # → (level, at)

    def _apply(
        self, key_id: str, limits: Limits, request_cost: int, token_cost: int
    ) -> tuple[bool, float, float]:
        buckets = (
            ((key_id, "requests"), limits.requests_per_minute, request_cost),
            ((key_id, "tokens"), limits.tokens_per_minute, token_cost),
        )
        with self._lock:
            now = time.monotonic()
            levels = [self._level(name, capacity, now) for name, capacity, _ in buckets]
            allowed = all(
                capacity is None or level >= cost
                for (_, capacity, cost), level in zip(buckets, levels, strict=True)
            )
            if allowed:
                for index, (name, capacity, cost) in enumerate(buckets):
                    if capacity is not None:
                        levels[index] = min(capacity, levels[index] - cost)
                        self._buckets[name] = (levels[index], now)
        return allowed, levels[0], levels[1]

    def _level(self, name: tuple[str, Dimension], capacity: int | None, now: float) -> float:
        if capacity is None:
            return 0.0
        stored = self._buckets.get(name)
        return capacity if stored is None else _refill(stored[0], now - stored[1], capacity)


# KEYS: the request bucket, the token bucket (hashes of level and the time it was stored at).
# ARGV: request capacity, request cost, token capacity, token cost; capacity 0 = unlimited,
# a negative cost is a refund. Returns {allowed, request level, token level}, the levels as
# strings because Redis truncates Lua numbers to integers.
_TAKE_SCRIPT = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local levels = {0, 0}
local allowed = true
for i = 1, 2 do
  local capacity = tonumber(ARGV[2 * i - 1])
  if capacity > 0 then
    local stored = redis.call('HMGET', KEYS[i], 'level', 'at')
    local level = capacity
    if stored[1] then
      local elapsed = math.max(0, now - tonumber(stored[2]))
      level = math.min(capacity, tonumber(stored[1]) + elapsed * capacity / 60)
    end
    if level < tonumber(ARGV[2 * i]) then
      allowed = false
    end
    levels[i] = level
  end
end
if allowed then
  for i = 1, 2 do
    local capacity = tonumber(ARGV[2 * i - 1])
    if capacity > 0 then
      local level = math.min(capacity, levels[i] - tonumber(ARGV[2 * i]))
      levels[i] = level
      redis.call('HSET', KEYS[i], 'level', string.format('%.17g', level),
                 'at', string.format('%.17g', now))
      -- Once full, a bucket is the same as no bucket: let it vanish a second later.
      redis.call('PEXPIRE', KEYS[i], math.ceil((capacity - level) * 60000 / capacity) + 1000)
    end
  end
end
return {allowed and 1 or 0, string.format('%.17g', levels[1]), string.format('%.17g', levels[2])}
"""


class RedisRateLimiter(RateLimiter):
    """The token buckets in Redis, shared by every gateway; each decision is one script call."""

    def __init__(self, client: redis.Redis, prefix: str = "hearth:rl:") -> None:
        self._script = client.register_script(_TAKE_SCRIPT)
        self._prefix = prefix

    def _apply(
        self, key_id: str, limits: Limits, request_cost: int, token_cost: int
    ) -> tuple[bool, float, float]:
        if limits.requests_per_minute is None and limits.tokens_per_minute is None:
            return True, 0.0, 0.0
        # The hash tag keeps a key's two buckets in one slot, as a script needs on a cluster.
        keys = [f"{self._prefix}{{{key_id}}}:requests", f"{self._prefix}{{{key_id}}}:tokens"]
        args = [
            limits.requests_per_minute or 0,
            request_cost,
            limits.tokens_per_minute or 0,
            token_cost,
        ]
        allowed, request_level, token_level = self._script(keys=keys, args=args)
        return bool(allowed), float(request_level), float(token_level)
