"""Budgets (controlplane/billing/budgets.py): admission reserves a request's maximum cost, every
settlement releases it and adds the real cost, and concurrent requests on PostgreSQL never pass
the limit. Also the async discount, and the budget and limits API."""

from __future__ import annotations

import json
import threading
from decimal import ROUND_UP, Decimal

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.accounts.models import ApiKey, Org
from controlplane.api.errors import ApiError
from controlplane.billing.budgets import SpendCounter, key_scope, month_of
from controlplane.billing.models import UsageRecord
from controlplane.billing.pricing import compute_costs, max_cost
from controlplane.catalog.models import Price
from controlplane.dispatch.admission import admit
from controlplane.events.models import Event
from controlplane.jobs.models import Job
from controlplane.jobs.settlement import record_completion, record_completions
from inference.protocol.messages import CompletionResult, Usage

pytestmark = pytest.mark.django_db(transaction=True)  # admission commits, as in production

PROMPT = "review this change"


def body(model: str, max_tokens: int, queue: bool = True) -> bytes:
    return json.dumps(
        {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "queue": queue}
    ).encode()


def submit(key: str, model: str, max_tokens: int, queue: bool = True) -> Job:
    return admit(f"Bearer {key}", body(model, max_tokens, queue), Job.TEXT, None, None).job


def result(job: Job, completion: int, cached: int = 0) -> CompletionResult:
    """A node's result for `job` that generated `completion` tokens."""
    return CompletionResult(
        request_id=job.request_id,
        job_id=job.id,
        node="node-1",
        text="ok",
        token_ids=list(range(completion)),
        finish_reason="length",
        usage=Usage(len(job.prompt_token_ids), cached, completion),
    )


def complete(job: Job, completion: int, cached: int = 0) -> None:
    record_completion(result(job, completion, cached))


def counter(org, scope="org") -> SpendCounter:
    return SpendCounter.objects.get(org=org, scope=scope, month=month_of(timezone.now()))


def request_max_cost(model, max_tokens: int, discount: int = 0) -> Decimal:
    job = submit_probe(model)
    return max_cost(model.current_price(), len(job.prompt_token_ids), max_tokens, discount)


def submit_probe(model) -> Job:
    """A job of another org, to learn the prompt's token count."""
    org = Org.objects.create(slug=f"probe-{Org.objects.count()}", name="probe")
    _, key = ApiKey.objects.create_key(org, "probe")
    return submit(key, model.id, 1)


@pytest.fixture
def budgeted(org_a, key_a, tiny):
    """Org A with a budget of four requests' maximum cost (max_tokens 40), to the micro-dollar
    above, and less than five."""
    cost = request_max_cost(tiny, 40)
    org_a.monthly_budget_usd = (cost * 4).quantize(Decimal("1e-6"), rounding=ROUND_UP)
    assert org_a.monthly_budget_usd < cost * 5
    org_a.save()
    return cost


def test_concurrent_requests_never_pass_the_budget(org_a, key_a, tiny, budgeted):
    """50 requests at once whose maximum costs add up to 12.5 budgets: exactly 4 fit."""
    admitted, refused = [], []
    barrier = threading.Barrier(50)

    def one() -> None:
        barrier.wait()
        try:
            admitted.append(submit(key_a, tiny.id, 40))
        except ApiError as error:
            refused.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=one) for _ in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert (len(admitted), len(refused)) == (4, 46), [e.message for e in refused][:3]
    assert {(e.status, e.code) for e in refused} == {(402, "budget_exceeded")}
    assert Job.objects.filter(org=org_a).count() == 4  # a refused request writes nothing
    assert Event.objects.filter(org=org_a).count() == 4
    assert counter(org_a).reserved == budgeted * 4
    for job in admitted:
        complete(job, completion=40)  # the worst case: every allowed token
    spent = counter(org_a)
    assert spent.reserved == 0 and spent.spent <= org_a.monthly_budget_usd
    ledger = sum(r.total_cost for r in UsageRecord.objects.filter(org=org_a))
    assert spent.spent == ledger == budgeted * 4
    with pytest.raises(ApiError) as exceeded:
        submit(key_a, tiny.id, 1)
    assert exceeded.value.status == 402 and "monthly budget" in exceeded.value.message


def test_settlement_releases_the_reservation_and_adds_the_real_cost(org_a, key_a, tiny, budgeted):
    job = submit(key_a, tiny.id, 40)
    assert job.reserved_cost == budgeted and job.budget_scopes == ["org"]
    complete(job, completion=3, cached=2)
    record = UsageRecord.objects.get(request_id=job.request_id)
    assert record.total_cost < budgeted
    assert (counter(org_a).spent, counter(org_a).reserved) == (record.total_cost, 0)


def test_results_settled_together_settle_the_budgets_as_one_at_a_time_would(org_a, key_a, tiny):
    """A report window's results in one transaction: the counters' UPDATEs add up each org, key and
    reserved scopes' costs, and come out as separate settlements would leave them."""
    cost = request_max_cost(tiny, 40)
    org_a.monthly_budget_usd = cost * 10
    org_a.save()
    limited = ApiKey.objects.get(org=org_a)
    limited.monthly_budget_usd = cost * 10
    limited.save()
    _, other = ApiKey.objects.create_key(org_a, "other")  # the org's budget only
    jobs = [submit(key_a, tiny.id, 40) for _ in range(3)] + [submit(other, tiny.id, 40)]
    failed = submit(other, tiny.id, 40)
    assert counter(org_a).reserved == cost * 5
    payloads = [result(job, n) for job, n in zip(jobs, [1, 5, 40, 7], strict=True)]
    payloads.append(CompletionResult(failed.request_id, node="node-1", error="bad request"))
    assert record_completions(payloads) == [True] * 5
    ledger = {r.request_id: r.total_cost for r in UsageRecord.objects.filter(org=org_a)}
    assert (counter(org_a).spent, counter(org_a).reserved) == (sum(ledger.values()), 0)
    key_counter = counter(org_a, key_scope(limited.pk))
    key_spent = sum(ledger[job.request_id] for job in jobs[:3])
    assert (key_counter.spent, key_counter.reserved) == (key_spent, 0)


@pytest.mark.parametrize("ending", ["cancel", "expire", "fail", "node_error"])
def test_a_job_that_never_runs_releases_everything(org_a, key_a, tiny, budgeted, ending):
    job = submit(key_a, tiny.id, 40)
    if ending == "cancel":
        job.cancel()
    elif ending == "expire":
        job.expire()
    elif ending == "fail":
        job.fail("broken")
    else:
        record_completion(CompletionResult(job.request_id, node="node-1", error="bad request"))
    assert (counter(org_a).spent, counter(org_a).reserved) == (0, 0)
    job.cancel()  # settled already: releases nothing twice
    assert counter(org_a).reserved == 0


def test_a_key_budget_limits_only_that_key(org_a, key_a, tiny):
    cost = request_max_cost(tiny, 40)
    limited = ApiKey.objects.get(org=org_a)
    limited.monthly_budget_usd = cost.quantize(Decimal("1e-6"), rounding=ROUND_UP)
    limited.save()
    _, other = ApiKey.objects.create_key(org_a, "other")
    submit(key_a, tiny.id, 40)
    with pytest.raises(ApiError):
        submit(key_a, tiny.id, 40)
    submit(other, tiny.id, 40)
    submit(other, tiny.id, 40)
    assert counter(org_a, key_scope(limited.pk)).reserved == cost
    assert not SpendCounter.objects.filter(scope="org").exists()  # the org has no budget


def test_a_refusal_by_one_scope_leaves_the_others_untouched(org_a, key_a, tiny):
    """Org and key both limited, in one statement: the key refuses, so the org's reservation,
    taken by the same UPDATE, is given back before the 402."""
    cost = request_max_cost(tiny, 40)
    org_a.monthly_budget_usd = cost * 10
    org_a.save()
    limited = ApiKey.objects.get(org=org_a)
    limited.monthly_budget_usd = cost.quantize(Decimal("1e-6"), rounding=ROUND_UP)
    limited.save()
    submit(key_a, tiny.id, 40)
    with pytest.raises(ApiError) as refused:
        submit(key_a, tiny.id, 40)
    assert refused.value.status == 402 and "this API key's" in refused.value.message
    assert counter(org_a).reserved == cost
    assert counter(org_a, key_scope(limited.pk)).reserved == cost
    assert Job.objects.filter(org=org_a).count() == 1


def test_a_budget_set_mid_month_counts_what_the_ledger_already_holds(client, org_a, key_a, tiny):
    job = submit(key_a, tiny.id, 40)
    complete(job, completion=40)
    spent = UsageRecord.objects.get(request_id=job.request_id).total_cost
    response = client.post(
        "/v1/budget",
        {"monthly_budget_usd": str(spent.quantize(Decimal("1e-6"), rounding=ROUND_UP))},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {key_a}",
    )
    assert response.status_code == 200, response.json()
    assert response.json()["spent_usd"] == format(spent.normalize(), "f")
    with pytest.raises(ApiError) as exceeded:
        submit(key_a, tiny.id, 1)  # nothing is left
    assert exceeded.value.code == "budget_exceeded"


def test_async_work_gets_the_discount_and_sync_work_does_not(org_a, key_a, tiny):
    price = tiny.current_price()
    Price.objects.filter(pk=price.pk).update(async_discount_percent=50)
    price.refresh_from_db()
    queued, sync = submit(key_a, tiny.id, 8), submit(key_a, tiny.id, 8, queue=False)
    for job in (queued, sync):
        complete(job, completion=8, cached=2)
    prompt = len(queued.prompt_token_ids)
    full = compute_costs(
        prompt, 2, 8, price.input_per_mtok, price.cached_input_per_mtok, price.output_per_mtok
    )
    async_row = UsageRecord.objects.get(request_id=queued.request_id)
    sync_row = UsageRecord.objects.get(request_id=sync.request_id)
    assert (sync_row.discount_percent, sync_row.total_cost) == (0, full.total)
    assert async_row.discount_percent == 50
    assert (
        async_row.total_cost == full.total / 2 and async_row.cache_savings == full.cache_savings / 2
    )
    queued.refresh_from_db()
    assert queued.result["cost"]["total"] == format(async_row.total_cost.normalize(), "f")


def test_the_models_list_shows_the_discount(client, key_a, tiny):
    Price.objects.filter(model=tiny).update(async_discount_percent=15)
    response = client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {key_a}")
    [listed] = [m for m in response.json()["data"] if m["id"] == tiny.id]
    assert listed["pricing"]["async_discount_percent"] == 15


# The API


def post(client, path: str, key: str, payload) -> tuple[int, dict]:
    response = client.post(
        path,
        json.dumps(payload),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {key}",
    )
    return response.status_code, response.json()


def test_budget_and_key_limits_round_trip(client, org_a, key_a, key_b):
    status, budget = post(client, "/v1/budget", key_a, {"monthly_budget_usd": "250.50"})
    assert status == 200
    assert (budget["monthly_budget_usd"], budget["spent_usd"], budget["reserved_usd"]) == (
        "250.5",
        "0",
        "0",
    )
    prefix = ApiKey.objects.get(org=org_a).prefix
    status, limits = post(
        client,
        f"/v1/api_keys/{prefix}/limits",
        key_a,
        {"monthly_budget_usd": 10, "requests_per_minute": 60, "tokens_per_minute": 40000},
    )
    assert status == 200
    assert (limits["monthly_budget_usd"], limits["requests_per_minute"]) == ("10", 60)
    listed = client.get("/v1/budget", HTTP_AUTHORIZATION=f"Bearer {key_a}").json()
    assert listed["keys"][0]["tokens_per_minute"] == 40000
    status, lifted = post(
        client, f"/v1/api_keys/{prefix}/limits", key_a, {"tokens_per_minute": None}
    )
    assert lifted["tokens_per_minute"] is None and lifted["requests_per_minute"] == 60
    # Another org's key is not found; the other org's budget is untouched.
    assert (
        post(client, f"/v1/api_keys/{prefix}/limits", key_b, {"requests_per_minute": 1})[0] == 404
    )
    assert Org.objects.get(slug="globex").monthly_budget_usd is None


@pytest.mark.parametrize(
    ("path", "payload", "param"),
    [
        ("/v1/budget", {"monthly_budget_usd": "-1"}, "monthly_budget_usd"),
        ("/v1/budget", {"monthly_budget_usd": "ten dollars"}, "monthly_budget_usd"),
        ("/v1/budget", {"monthly_budget_usd": True}, "monthly_budget_usd"),
        ("/v1/budget", {"monthly_budget_usd": "NaN"}, "monthly_budget_usd"),
        ("/v1/budget", {"monthly_budget_usd": "0.0000001"}, "monthly_budget_usd"),
        ("/v1/budget", {}, "monthly_budget_usd"),
        ("/v1/budget", {"monthly_budget": 5}, "monthly_budget"),
        ("KEY", {"requests_per_minute": 0}, "requests_per_minute"),
        ("KEY", {"tokens_per_minute": "many"}, "tokens_per_minute"),
        ("KEY", {"monthly_budget_usd": -0.01}, "monthly_budget_usd"),
    ],
)
def test_bad_limits_are_a_400_naming_the_field(client, org_a, key_a, path, payload, param):
    if path == "KEY":
        path = f"/v1/api_keys/{ApiKey.objects.get(org=org_a).prefix}/limits"
    status, error = post(client, path, key_a, payload)
    assert status == 400 and error["error"]["param"] == param, error
    org_a.refresh_from_db()
    assert org_a.monthly_budget_usd is None
    key = ApiKey.objects.get(org=org_a)
    assert (key.monthly_budget_usd, key.requests_per_minute, key.tokens_per_minute) == (
        None,
        None,
        None,
    )
