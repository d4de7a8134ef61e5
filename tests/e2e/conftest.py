"""Fixtures for the multi-process tests: Hearth's production mode against the test database."""

from __future__ import annotations

import os

import pytest
from django.conf import settings

from controlplane.accounts.models import ApiKey, Org
from tests.controlplane.conftest import priced_model
from tests.e2e.browser import browser_log, page  # noqa: F401  (fixtures of the console tests)
from tests.e2e.stack import ProductionStack, RedisServer


def test_database_url() -> str:
    database = settings.DATABASES["default"]
    return f"postgres://{database['USER']}@{database['HOST']}:{database['PORT']}/{database['NAME']}"


test_database_url.__test__ = False  # a helper, not a test


@pytest.fixture
def tiny_model(tiny_llama_dir):
    """A catalog model served from tiny random weights, under an id of this test run's own (the
    node registry in Redis is shared by every run on the machine)."""
    return priced_model(f"tiny-{os.getpid()}", str(tiny_llama_dir), 256)


@pytest.fixture
def acme_key(transactional_db):
    org = Org.objects.create(slug="acme", name="Acme")
    _, key = ApiKey.objects.create_key(org, "e2e")
    return key


def production_stack(redis_url: str, log_dir) -> ProductionStack:
    """The stack's processes, not started: on the test database and `redis_url`, with webhooks
    to loopback allowed and retried within seconds."""
    stack = ProductionStack(
        test_database_url(),
        redis_url,
        f"{settings.TEST_BROKER_NAMESPACE}-{log_dir.name}",
        log_dir,
    )
    stack.env.update(
        HEARTH_WEBHOOK_ALLOW_PRIVATE="1",
        HEARTH_WEBHOOK_RETRY_SCHEDULE_S="0.5,1,1,1,1,1,1",
        HEARTH_WEBHOOK_TIMEOUT_S="1",
        # A killed worker's attempt is taken over within seconds (the fault tests), not a minute.
        HEARTH_WEBHOOK_CLAIM_LEASE_MARGIN_S="3",
    )
    return stack


@pytest.fixture
def stack(transactional_db, tmp_path):
    """Gateway, worker and sweeper (as production runs them) started on the shared Redis; each
    test starts the nodes it needs."""
    running = production_stack(settings.DRAMATIQ_BROKER["OPTIONS"]["url"], tmp_path)
    running.start_gateway()
    running.start_worker()
    running.start_sweeper()
    try:
        yield running
    finally:
        running.stop()
        import redis

        client = redis.Redis.from_url(settings.DRAMATIQ_BROKER["OPTIONS"]["url"])
        for key in client.scan_iter(match=f"{running.env['HEARTH_BROKER_NAMESPACE']}*"):
            client.delete(key)


@pytest.fixture
def own_redis(tmp_path):
    """A Redis of the test's own, which it may restart (never the shared one)."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture
def stack_on_own_redis(transactional_db, tmp_path, own_redis):
    """Gateway, worker and sweeper started on `own_redis`; the test starts the nodes."""
    running = production_stack(own_redis.url, tmp_path)
    running.start_gateway()
    running.start_worker()
    running.start_sweeper()
    try:
        yield running
    finally:
        running.stop()
