"""Shared set-up for control-plane tests: two orgs, so every endpoint is also tested across orgs."""

from __future__ import annotations

import json
import uuid

import dramatiq
import pytest
import redis
from django.conf import settings

from controlplane.accounts.management.commands.demo import DEMO_PRICES
from controlplane.accounts.models import ApiKey, Org
from controlplane.catalog import registry
from controlplane.catalog.models import Price, ServedModel
from controlplane.catalog.registry import RedisRouteState
from controlplane.dispatch.group_commit import stop_writer
from inference.protocol.heartbeat import MemoryHeartbeat


def priced_model(model_id: str, source: str, context_length: int) -> ServedModel:
    """A catalog model at the demo prices (input 0.60, cached input 0.10, output 3.00 per 1M)."""
    model = ServedModel.objects.create(id=model_id, source=source, context_length=context_length)
    Price.objects.create(model=model, **DEMO_PRICES)
    return model


@pytest.fixture(scope="session", autouse=True)
def job_writer_stops(django_db_setup, django_db_blocker):
    """Admission's writer thread (dispatch/group_commit.py) holds a connection to the test
    database; it ends before the database is dropped."""
    yield
    with django_db_blocker.unblock():
        stop_writer()


@pytest.fixture
def org_a(db):
    return Org.objects.create(slug="acme", name="Acme")


@pytest.fixture
def org_b(db):
    return Org.objects.create(slug="globex", name="Globex")


@pytest.fixture
def key_a(org_a):
    _, key = ApiKey.objects.create_key(org_a, "ci")
    return key


@pytest.fixture
def key_b(org_b):
    _, key = ApiKey.objects.create_key(org_b, "ci")
    return key


@pytest.fixture
def smollm2(db):
    return priced_model("SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", 8192)


@pytest.fixture
def tiny(tiny_llama_dir):
    """The tiny random Llama as catalog model `tiny`, with a 64-token context."""
    return priced_model("tiny", str(tiny_llama_dir), 64)


@pytest.fixture
def api(client):
    """Django's test client, speaking JSON with a bearer key."""

    class Api:
        def get(self, path: str, key: str | None = None, **headers):
            if key is not None:
                headers["HTTP_AUTHORIZATION"] = f"Bearer {key}"
            return client.get(path, **headers)

    return Api()


@pytest.fixture
def post(client):
    """POST a JSON body (or `raw` bytes) with an API key, through Django's test client."""

    def post(path: str, body, key: str | None = None, raw: bool = False, **headers):
        if key is not None:
            headers["HTTP_AUTHORIZATION"] = f"Bearer {key}"
        data = body if raw else json.dumps(body)
        return client.post(path, data=data, content_type="application/json", **headers)

    return post


@pytest.fixture
def redis_state():
    """Routing state in the real Redis under this test's own prefix; deleted afterwards."""
    client = redis.Redis.from_url(settings.DRAMATIQ_BROKER["OPTIONS"]["url"])
    prefix = f"hearth-test-route-{uuid.uuid4().hex[:8]}:"
    yield RedisRouteState(client, prefix)
    for key in client.scan_iter(match=prefix + "*"):
        client.delete(key)


@pytest.fixture
def live(settings):
    """A MemoryHeartbeat the registry reads (no registry cache: each test changes it)."""
    settings.NODE_REGISTRY_TTL_S = 0
    heartbeat = MemoryHeartbeat()
    registry.use_memory_heartbeat(heartbeat)
    yield heartbeat
    registry.use_memory_heartbeat(None)
    dramatiq.get_broker().flush_all()
