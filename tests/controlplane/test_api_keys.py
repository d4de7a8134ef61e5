"""API keys: creation, Bearer authentication, revocation, expiry; every failure a 401 in
OpenAI's error shape."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.utils import timezone

from controlplane.accounts.models import ApiKey, KeyRejected, hash_secret
from tests.controlplane.openai_spec import validate


def assert_openai_error(response, status: int, code: str) -> None:
    assert response.status_code == status
    body = response.json()
    validate(body, "ErrorResponse")
    assert body["error"]["code"] == code
    assert body["error"]["message"]


def test_it_stores_only_a_hash_of_the_secret(org_a):
    key, presented = ApiKey.objects.create_key(org_a, "laptop")
    prefix, secret = presented.removeprefix("hk_").split("_", 1)
    assert key.prefix == prefix
    assert key.secret_hash == hash_secret(secret)
    assert secret not in key.secret_hash


def test_it_accepts_a_valid_key_and_records_its_use(api, key_a, smollm2):
    response = api.get("/v1/models", key_a)
    assert response.status_code == 200
    key = ApiKey.objects.get()
    assert key.last_used_at is not None


def test_it_rejects_a_request_without_a_key(api, smollm2):
    assert_openai_error(api.get("/v1/models"), 401, "missing_api_key")


@pytest.mark.parametrize(
    "header",
    ["Token abc", "Bearer", "Bearer not-a-key", "Basic dXNlcjpwYXNz"],
)
def test_it_rejects_a_malformed_header_or_key(client, header, smollm2):
    response = client.get("/v1/models", HTTP_AUTHORIZATION=header)
    assert_openai_error(response, 401, "invalid_api_key")


def test_it_rejects_a_wrong_secret_for_a_real_prefix(api, key_a, smollm2):
    forged = key_a[:16] + ("A" if key_a[16] != "A" else "B") + key_a[17:]
    assert_openai_error(api.get("/v1/models", forged), 401, "invalid_api_key")


def test_it_rejects_a_revoked_key(api, key_a, smollm2):
    key = ApiKey.objects.get()
    assert key.revoke()
    assert not key.revoke()  # revoking twice changes nothing
    assert_openai_error(api.get("/v1/models", key_a), 401, "revoked_api_key")


def test_it_rejects_an_expired_key(api, org_a, smollm2):
    _, presented = ApiKey.objects.create_key(
        org_a, "short-lived", expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert_openai_error(api.get("/v1/models", presented), 401, "expired_api_key")


def test_each_org_key_resolves_to_its_own_org(org_a, org_b, key_a, key_b):
    assert ApiKey.objects.authenticate(key_a).org == org_a
    assert ApiKey.objects.authenticate(key_b).org == org_b
    with pytest.raises(KeyRejected):
        ApiKey.objects.authenticate(key_a.replace(key_a[3:15], key_b[3:15]))


def test_management_commands_create_an_org_and_print_only_the_key(db, capsys):
    call_command("createorg", "initech", "--name", "Initech")
    capsys.readouterr()
    call_command("createapikey", "--org", "initech", "--name", "deploy")
    printed = capsys.readouterr().out.strip()
    assert printed.startswith("hk_") and "\n" not in printed
    assert ApiKey.objects.authenticate(printed).org.slug == "initech"


def test_migrations_match_the_models(db):
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)


def test_demo_seeds_an_org_user_key_and_priced_model_and_can_run_twice(db, capsys):
    from controlplane.catalog.models import ServedModel

    call_command("demo")
    first = capsys.readouterr().out
    call_command("demo")
    second = capsys.readouterr().out
    keys = [
        line.split()[-1] for line in (first + second).splitlines() if line.startswith("API key")
    ]
    assert len(keys) == 2 and keys[0] != keys[1]
    assert all(ApiKey.objects.authenticate(k).org.slug == "demo" for k in keys)
    model = ServedModel.objects.get(id="SmolLM2-135M-Instruct")
    assert model.prices.count() == 1
    assert str(model.current_price().cached_input_per_mtok) == "0.100000"
    assert "Login:    demo / demo-password" in first and "demo-password" in second
    User = get_user_model()
    user = User.objects.get(username="demo")
    user.set_password("something-else")
    user.save()
    call_command("demo")
    third = capsys.readouterr().out
    assert "something-else" not in third and "demo-password" not in third
    assert "Console:  http://127.0.0.1:8000/console/" in third


def test_runnode_refuses_a_model_missing_from_the_catalog(db):
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="no enabled model"):
        call_command("runnode", "--model", "nope")
