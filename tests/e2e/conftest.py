"""Fixtures for the multi-process tests: Hearth's production mode against the test database."""

from __future__ import annotations

import os

import pytest
from django.conf import settings

from controlplane.accounts.models import ApiKey, Org
from tests.controlplane.conftest import priced_model
from tests.e2e.stack import ProductionStack


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


@pytest.fixture
def stack(transactional_db, tmp_path):
    """Gateway and worker started; each test starts the nodes it needs."""
    running = ProductionStack(
        test_database_url(),
        settings.DRAMATIQ_BROKER["OPTIONS"]["url"],
        f"{settings.TEST_BROKER_NAMESPACE}-{tmp_path.name}",
        tmp_path,
    )
    running.start_gateway()
    running.start_worker()
    try:
        yield running
    finally:
        running.stop()
        import redis

        client = redis.Redis.from_url(settings.DRAMATIQ_BROKER["OPTIONS"]["url"])
        for key in client.scan_iter(match=f"{running.env['HEARTH_BROKER_NAMESPACE']}*"):
            client.delete(key)
