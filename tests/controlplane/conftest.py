"""Shared set-up for control-plane tests: two orgs, so every endpoint is also tested across orgs."""

from __future__ import annotations

from decimal import Decimal

import pytest

from controlplane.accounts.models import ApiKey, Org
from controlplane.catalog.models import Price, ServedModel


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
    model = ServedModel.objects.create(
        id="SmolLM2-135M-Instruct", source="SmolLM2-135M-Instruct", context_length=8192
    )
    Price.objects.create(
        model=model,
        input_per_mtok=Decimal("0.60"),
        cached_input_per_mtok=Decimal("0.10"),
        output_per_mtok=Decimal("3.00"),
    )
    return model


@pytest.fixture
def api(client):
    """Django's test client, speaking JSON with a bearer key."""

    class Api:
        def get(self, path: str, key: str | None = None, **headers):
            if key is not None:
                headers["HTTP_AUTHORIZATION"] = f"Bearer {key}"
            return client.get(path, **headers)

    return Api()
