"""GET /v1/models: OpenAI's shape plus context length and prices, also through the official SDK."""

from __future__ import annotations

import openai
import pytest

from controlplane.accounts.models import ApiKey, Org
from controlplane.catalog.models import ServedModel
from tests.controlplane.openai_spec import validate


def test_it_lists_enabled_models_with_prices(api, key_a, smollm2):
    ServedModel.objects.create(id="retired", source="x", context_length=1024, enabled=False)
    response = api.get("/v1/models", key_a)
    assert response.status_code == 200
    body = response.json()
    validate(body, "ListModelsResponse")
    assert [m["id"] for m in body["data"]] == ["SmolLM2-135M-Instruct"]
    [model] = body["data"]
    assert model["context_length"] == 8192
    assert model["pricing"] == {
        "input": "0.6",
        "cached_input": "0.1",
        "output": "3",
        "unit": "USD per 1M tokens",
        "async_discount_percent": 0,
    }


def test_it_shows_one_model_and_404s_an_unknown_one(api, key_a, smollm2):
    response = api.get("/v1/models/SmolLM2-135M-Instruct", key_a)
    assert response.status_code == 200
    validate(response.json(), "Model")
    missing = api.get("/v1/models/gpt-9", key_a)
    assert missing.status_code == 404
    validate(missing.json(), "ErrorResponse")
    assert missing.json()["error"]["code"] == "model_not_found"


def test_unknown_paths_answer_in_openai_error_shape(api, key_a):
    response = api.get("/v1/no-such-endpoint", key_a)
    assert response.status_code == 404
    validate(response.json(), "ErrorResponse")


@pytest.mark.django_db(transaction=True)
def test_the_official_sdk_lists_and_retrieves_models(live_server, smollm2):
    _, key = ApiKey.objects.create_key(Org.objects.create(slug="sdk", name="SDK"), "sdk")
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=key, max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]
    assert models.data[0].model_extra["pricing"]["cached_input"] == "0.1"
    assert client.models.retrieve("SmolLM2-135M-Instruct").owned_by == "hearth"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    bad = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="hk_nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as error:
        bad.models.list()
    assert error.value.code == "invalid_api_key"


def test_the_gateways_catalog_cache_sees_changes_within_its_window(db, monkeypatch):
    from controlplane.catalog import models as catalog

    model = ServedModel.objects.create(id="cached", source="x", context_length=64)
    assert ServedModel.objects.enabled("cached").context_length == 64
    model.context_length = 128
    model.save()  # a change in this process clears the cache at once
    assert ServedModel.objects.enabled("cached").context_length == 128
    # Another process disables it (no signal here): served from the cache within the window,
    # refused after it.
    ServedModel.objects.filter(id="cached").update(enabled=False)
    assert ServedModel.objects.enabled("cached") is not None
    monkeypatch.setattr(catalog, "CATALOG_CACHE_S", 0.0)
    assert ServedModel.objects.enabled("cached") is None
    assert ServedModel.objects.enabled("never-existed") is None
