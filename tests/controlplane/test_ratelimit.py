"""Per-key rate limits (controlplane/billing/ratelimit.py), in memory and on the real Redis.

Refill makes results depend on time, so most tests use limits low enough that nothing
refills by a whole unit while they run (10 requests per minute refills one every 6 s); the
refill test bounds what it sees by the time it measured instead.
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid

import pytest
import redis

from controlplane.billing.ratelimit import (
    BucketReading,
    Decision,
    Limits,
    MemoryRateLimiter,
    RedisRateLimiter,
    format_duration,
)

REDIS_URL = os.environ.get("HEARTH_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

HEADER_NAMES = {
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
}


@pytest.fixture
def redis_prefix():
    """A key prefix of this test's own, and its keys deleted afterwards."""
    prefix = f"hearth-test-rl:{os.getpid()}:{uuid.uuid4().hex}:"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=prefix + "*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def redis_limiter(redis_prefix):
    client = redis.Redis.from_url(REDIS_URL)
    yield RedisRateLimiter(client, prefix=redis_prefix)
    client.close()


@pytest.fixture(params=["memory", "redis"])
def limiter(request):
    if request.param == "memory":
        return MemoryRateLimiter()
    return request.getfixturevalue("redis_limiter")


def remaining(decision: Decision, dimension: str) -> int:
    return int(decision.headers()[f"x-ratelimit-remaining-{dimension}"])


def test_it_passes_exactly_the_request_limit_in_a_burst(limiter):
    limits = Limits(requests_per_minute=10, tokens_per_minute=1000)
    decisions = [limiter.take("key", limits, 10) for _ in range(15)]

    passed = [decision for decision in decisions if decision.allowed]
    assert decisions[:10] == passed
    assert [remaining(decision, "requests") for decision in passed] == list(range(9, -1, -1))
    for decision in passed:
        assert set(decision.headers()) == HEADER_NAMES
        assert decision.headers()["x-ratelimit-limit-requests"] == "10"
        assert decision.headers()["x-ratelimit-limit-tokens"] == "1000"
    for decision in decisions[10:]:
        headers = decision.headers()
        assert set(headers) == HEADER_NAMES | {"retry-after"}
        assert decision.refused_by == "requests" and not decision.too_large
        assert headers["x-ratelimit-remaining-requests"] == "0"
        # One request refills in 6 s at 10 per minute; rounded up, so never 0.
        assert 1 <= int(headers["retry-after"]) <= 6
        # The refused requests took none of their 10 tokens each.
        assert headers["x-ratelimit-remaining-tokens"] == "900"


def test_it_passes_exactly_the_token_limit_and_refuses_a_request_larger_than_it(limiter):
    limits = Limits(tokens_per_minute=100)

    costs = [30, 30, 30, 30, 10, 1]
    decisions = [limiter.take("key", limits, cost) for cost in costs]

    assert [decision.allowed for decision in decisions] == [True, True, True, False, True, False]
    assert [remaining(decision, "tokens") for decision in decisions] == [70, 40, 10, 10, 0, 0]
    refused = decisions[3]
    assert refused.refused_by == "tokens" and not refused.too_large
    # 20 tokens short at 100 per minute: 12 s, just under once the bucket refilled a little.
    assert refused.headers()["retry-after"] == "12"
    assert "x-ratelimit-limit-requests" not in refused.headers()

    too_large = limiter.take("fresh-key", limits, 101)
    assert not too_large.allowed
    assert too_large.refused_by == "tokens" and too_large.too_large
    assert "retry-after" not in too_large.headers()  # no wait would let it pass
    assert remaining(too_large, "tokens") == 100
    assert limiter.take("fresh-key", limits, 100).allowed


def test_it_refills_at_the_limit_per_sixty_seconds(limiter):
    limits = Limits(requests_per_minute=600)  # 10 per second
    while limiter.take("key", limits, 0).allowed:
        pass
    # The bucket now holds less than one request. Whatever refills from here until the last
    # call below is at most 10 per second of the time measured around it, plus that fraction.
    started = time.monotonic()
    assert not limiter.take("key", limits, 0).allowed
    time.sleep(0.3)
    passed = 0
    while limiter.take("key", limits, 0).allowed:
        passed += 1
    elapsed = time.monotonic() - started

    assert 3 <= passed <= 1 + elapsed * 10


def test_a_request_refused_on_tokens_takes_no_request_and_vice_versa(limiter):
    limits = Limits(requests_per_minute=3, tokens_per_minute=100)
    assert limiter.take("key", limits, 60).allowed

    refused_on_tokens = limiter.take("key", limits, 50)
    assert refused_on_tokens.refused_by == "tokens"
    assert remaining(refused_on_tokens, "requests") == 2
    after = limiter.take("key", limits, 40)
    assert after.allowed
    assert (remaining(after, "requests"), remaining(after, "tokens")) == (1, 0)

    limits = Limits(requests_per_minute=1, tokens_per_minute=6)
    assert limiter.take("other-key", limits, 1).allowed
    refused_on_requests = limiter.take("other-key", limits, 1)
    assert refused_on_requests.refused_by == "requests"
    assert remaining(refused_on_requests, "tokens") == 5
    assert remaining(limiter.take("other-key", limits, 5), "tokens") == 5


def test_it_reports_the_longer_wait_when_both_buckets_are_short(limiter):
    limits = Limits(requests_per_minute=1, tokens_per_minute=60)  # 1 token per second
    assert limiter.take("key", limits, 30).allowed

    decision = limiter.take("key", limits, 40)

    # A request refills in 60 s, the 10 missing tokens in 10 s.
    assert decision.refused_by == "requests"
    assert 59 <= int(decision.headers()["retry-after"]) <= 60


def test_concurrent_takes_never_pass_more_than_the_limit(limiter):
    limit = 10  # refills one request every 6 s
    limits = Limits(requests_per_minute=limit)
    start = threading.Barrier(16)
    allowed = []

    def client() -> None:
        start.wait()
        allowed.extend(limiter.take("key", limits, 0).allowed for _ in range(25))

    started = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started

    assert len(allowed) == 16 * 25
    # Exactly the limit unless the run took 6 s or more (then what refilled meanwhile).
    assert limit <= sum(allowed) <= limit + int(elapsed * limit / 60)


def test_a_refund_never_fills_a_bucket_above_its_capacity(limiter):
    limits = Limits(requests_per_minute=10, tokens_per_minute=100)
    assert remaining(limiter.take("key", limits, 30), "tokens") == 70

    limiter.refund("key", limits, 20)
    after_refund = limiter.take("key", limits, 0)
    assert remaining(after_refund, "tokens") == 90
    assert remaining(after_refund, "requests") == 8  # a refund gives back no request

    limiter.refund("key", limits, 50)
    full = limiter.take("key", limits, 0)
    assert remaining(full, "tokens") == 100
    assert full.headers()["x-ratelimit-reset-tokens"] == "0s"
    assert not limiter.take("key", limits, 101).allowed

    limiter.refund("fresh-key", limits, 1000)
    assert remaining(limiter.take("fresh-key", limits, 0), "tokens") == 100


def test_unlimited_dimensions_have_no_headers(limiter):
    requests_only = limiter.take("key", Limits(requests_per_minute=5), 10**9)
    assert requests_only.allowed
    assert set(requests_only.headers()) == {
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    }

    unlimited = limiter.take("key", Limits(), 10**9)
    assert unlimited.allowed and unlimited.headers() == {}


def test_it_rejects_invalid_limits_and_costs(limiter):
    with pytest.raises(ValueError, match="requests_per_minute"):
        Limits(requests_per_minute=0)
    with pytest.raises(ValueError, match="tokens_per_minute"):
        Limits(tokens_per_minute=-5)
    with pytest.raises(ValueError, match="tokens"):
        limiter.take("key", Limits(tokens_per_minute=10), -1)
    with pytest.raises(ValueError, match="tokens"):
        limiter.refund("key", Limits(tokens_per_minute=10), -1)


@pytest.mark.parametrize("seed", range(5))
def test_memory_and_redis_decide_alike(redis_limiter, seed):
    """The Lua script and the Python arithmetic agree step by step. Costs are whole units and
    nothing refills by a whole unit while this runs (1 token per second, 1 request per 6 s),
    so both see the same whole units and decide the same, refunds included."""
    rng = random.Random(seed)
    memory = MemoryRateLimiter()
    limits = {
        "both": Limits(requests_per_minute=10, tokens_per_minute=60),
        "requests": Limits(requests_per_minute=10),
        "tokens": Limits(tokens_per_minute=60),
    }
    for _ in range(60):
        key_id = rng.choice(list(limits))
        tokens = rng.choice([0, 1, 5, 20, 59, 60, 61])
        if rng.random() < 0.2:
            memory.refund(key_id, limits[key_id], tokens)
            redis_limiter.refund(key_id, limits[key_id], tokens)
            continue
        in_memory = memory.take(key_id, limits[key_id], tokens)
        in_redis = redis_limiter.take(key_id, limits[key_id], tokens)
        assert (in_memory.allowed, in_memory.refused_by, in_memory.too_large) == (
            in_redis.allowed,
            in_redis.refused_by,
            in_redis.too_large,
        )
        for dimension in ("requests", "tokens"):
            memory_reading = getattr(in_memory, dimension)
            redis_reading = getattr(in_redis, dimension)
            assert (memory_reading is None) == (redis_reading is None)
            if memory_reading is not None:
                assert memory_reading.remaining == redis_reading.remaining


def test_redis_buckets_expire_once_they_would_be_full(redis_limiter, redis_prefix):
    client = redis.Redis.from_url(REDIS_URL)
    redis_limiter.take("key", Limits(requests_per_minute=60, tokens_per_minute=600), 300)

    # Full again after 1 s (one request at 1 per second) and 30 s (300 tokens at 10 per
    # second); each bucket lives one second past that.
    requests_ttl = client.pttl(f"{redis_prefix}{{key}}:requests")
    tokens_ttl = client.pttl(f"{redis_prefix}{{key}}:tokens")
    client.close()
    assert 1000 < requests_ttl <= 2000
    assert 30_000 < tokens_ttl <= 31_000


def test_redis_limiter_works_with_a_client_that_decodes_responses(redis_prefix):
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    limiter = RedisRateLimiter(client, prefix=redis_prefix)

    decisions = [limiter.take("key", Limits(tokens_per_minute=10), 4) for _ in range(3)]

    client.close()
    assert [decision.allowed for decision in decisions] == [True, True, False]
    assert remaining(decisions[1], "tokens") == 2


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.0001, "1ms"),
        (0.12, "120ms"),
        (0.3, "300ms"),
        (0.999, "999ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (8.64, "8.64s"),
        (59.9991, "1m0s"),
        (60, "1m0s"),
        (179.56, "2m59.56s"),
        (360, "6m0s"),
        (3723.5, "1h2m3.5s"),
    ],
)
def test_it_formats_durations_as_openai_does(seconds, text):
    assert format_duration(seconds) == text


def test_headers_of_a_refused_decision():
    decision = Decision(
        allowed=False,
        refused_by="tokens",
        too_large=False,
        requests=BucketReading(limit=60, remaining=59, reset_s=1.0),
        tokens=BucketReading(limit=150_000, remaining=12, reset_s=359.9995),
        retry_after_s=2.01,
    )

    assert decision.headers() == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "150000",
        "x-ratelimit-remaining-tokens": "12",
        "x-ratelimit-reset-tokens": "6m0s",
        "retry-after": "3",
    }
