"""`GET /v1/usage` and the console's billing page against the ledger: every figure is the exact
Decimal sum of the UsageRecords it covers, per day, model and key, whatever the prices did."""

from __future__ import annotations

import csv
import io
import threading
import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from urllib.parse import urlencode

import pytest
from django.db import connections, transaction
from django.test import Client
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.accounts.models import ApiKey, Org
from controlplane.billing.invoices import Invoice
from controlplane.billing.models import UsageRecord
from controlplane.billing.pricing import decimal_string
from controlplane.billing.reports import month_bounds
from controlplane.billing.usage_days import UsageDay
from controlplane.catalog.models import Price, ServedModel
from tests.controlplane.conftest import priced_model
from tests.controlplane.test_console import member_of

AMOUNTS = ["input_cost", "cached_input_cost", "output_cost", "total_cost", "cache_savings"]
COST_KEYS = {
    "input": "input_cost",
    "cached_input": "cached_input_cost",
    "output": "output_cost",
    "total": "total_cost",
    "cache_savings": "cache_savings",
}


def record(org, api_key, price, prompt, cached, completion, at=None, mode="sync"):
    """A ledger row as the worker writes it, moved to `at` when given."""
    row = UsageRecord.objects.record(
        request_id=f"req_{uuid.uuid4().hex}",
        org=org,
        api_key=api_key,
        model=price.model_id,
        mode=mode,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        price=price,
        # As the worker charges it: the price's async discount for work that could wait.
        discount_percent=price.async_discount_percent if mode != "sync" else 0,
    )
    if at is not None:
        UsageRecord.objects.filter(pk=row.pk).update(created=at)
        row.refresh_from_db()
    return row


def ledger_sums(rows) -> dict:
    """The oracle: requests, tokens and amounts of `rows` added up in Python."""
    sums = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}
    sums.update({name: Decimal(0) for name in AMOUNTS})
    for row in rows:
        sums["requests"] += 1
        for name in sums:
            if name != "requests":
                sums[name] += getattr(row, name)
    return sums


def reported_sums(entry: dict) -> dict:
    """A report row or total in the oracle's terms, its decimal strings parsed back."""
    sums = {name: entry[name] for name in ("requests", "prompt_tokens", "cached_tokens")}
    sums["completion_tokens"] = entry["completion_tokens"]
    sums.update({column: Decimal(entry["cost"][key]) for key, column in COST_KEYS.items()})
    return sums


def usage(api, key, **params):
    return api.get(f"/v1/usage?{urlencode(params)}", key)


def iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


@pytest.fixture
def key_row_a(org_a, key_a):
    return ApiKey.objects.get(org=org_a)


@pytest.fixture
def price_a(smollm2):
    return smollm2.current_price()


def test_it_requires_an_api_key(api, db):
    response = usage(api, None)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "missing_api_key"


def test_it_totals_the_current_month_by_day_by_default(api, org_a, key_a, key_row_a, price_a):
    month_start, month_end = month_bounds(timezone.now().date())
    today = [record(org_a, key_row_a, price_a, 1000, 600, 200) for _ in range(3)]
    record(org_a, key_row_a, price_a, 50, 0, 5, at=month_start - timedelta(seconds=1))

    body = usage(api, key_a).json()

    assert body["object"] == "usage_report" and body["group_by"] == "day"
    assert (body["start"], body["end"]) == (iso(month_start), iso(month_end))
    [row] = body["data"]
    assert row["day"] == timezone.now().date().isoformat()
    assert reported_sums(row) == ledger_sums(today) == reported_sums(body["total"])
    assert row["cost"] == {
        "currency": "USD",
        "input": "0.00072",
        "cached_input": "0.00018",
        "output": "0.0018",
        "total": "0.0027",
        "cache_savings": "0.0009",
    }
    assert row["cache_hit_ratio"] == 0.6


def test_it_groups_by_day_model_and_key(api, org_a, key_a, key_row_a, price_a):
    other_price = priced_model("other-model", "other", 4096).current_price()
    second_key, _ = ApiKey.objects.create_key(org_a, "second")
    doomed_key, _ = ApiKey.objects.create_key(org_a, "doomed")
    start = datetime(2026, 3, 1, tzinfo=UTC)
    rows = [
        record(org_a, key_row_a, price_a, 100, 40, 10, at=start + timedelta(hours=1)),
        record(org_a, second_key, other_price, 200, 0, 20, at=start + timedelta(hours=30)),
        record(org_a, key_row_a, other_price, 300, 300, 30, at=start + timedelta(hours=31)),
        record(org_a, doomed_key, price_a, 400, 100, 0, at=start + timedelta(days=3)),
    ]
    doomed_key.delete()  # its usage stays, under no key
    rows = list(UsageRecord.objects.filter(org=org_a))
    end = start + timedelta(days=10)

    expected = {
        "day": lambda r: {"day": r.created.date().isoformat()},
        "model": lambda r: {"model": r.model},
        "key": lambda r: {
            "api_key_id": r.api_key_id,
            "api_key_name": r.api_key.name if r.api_key else None,
            "api_key_prefix": f"hk_{r.api_key.prefix}" if r.api_key else None,
        },
    }
    for group_by, group_of in expected.items():
        body = usage(api, key_a, start=iso(start), end=iso(end), group_by=group_by).json()
        groups = defaultdict(list)
        for row in rows:
            groups[tuple(group_of(row).items())].append(row)
        assert len(body["data"]) == len(groups), group_by
        for entry in body["data"]:
            identity = {name: entry[name] for name in dict(next(iter(groups)))}
            assert reported_sums(entry) == ledger_sums(groups[tuple(identity.items())])
        assert reported_sums(body["total"]) == ledger_sums(rows)


def test_it_counts_only_the_callers_org(api, org_a, key_a, key_row_a, org_b, key_b, price_a):
    ours = record(org_a, key_row_a, price_a, 10, 0, 1)
    theirs = record(org_b, ApiKey.objects.get(org=org_b), price_a, 7000, 7000, 700)
    for key, row in ((key_a, ours), (key_b, theirs)):
        for group_by in ("day", "model", "key"):
            body = usage(api, key, group_by=group_by).json()
            assert reported_sums(body["total"]) == ledger_sums([row])
            assert len(body["data"]) == 1


def test_end_is_exclusive_and_bounds_may_cut_through_days(api, org_a, key_a, key_row_a, price_a):
    day = datetime(2026, 5, 10, tzinfo=UTC)
    at = {hour: day + timedelta(hours=hour) for hour in (0, 11, 12, 14, 24 + 3, 48)}
    rows = {hour: record(org_a, key_row_a, price_a, hour + 1, 0, 1, at=t) for hour, t in at.items()}

    def total(start, end):
        return reported_sums(usage(api, key_a, start=start, end=end).json()["total"])

    assert total(iso(at[11]), iso(at[14])) == ledger_sums([rows[11], rows[12]])
    # Dates are their midnights: the 10th alone.
    assert total("2026-05-10", "2026-05-11") == ledger_sums([rows[h] for h in (0, 11, 12, 14)])
    # Whole days in the middle, part days at both edges.
    assert total(iso(at[12]), "2026-05-11T03:00:01") == ledger_sums([rows[h] for h in (12, 14, 27)])
    assert total(iso(at[11]), "2026-05-12T00:00:01") == ledger_sums(
        [rows[h] for h in (11, 12, 14, 27, 48)]
    )
    # An offset is converted to UTC; no offset means UTC.
    assert total("2026-05-10T13:00:00+01:00", "2026-05-10T12:00:01") == ledger_sums([rows[12]])
    assert total("2026-05-10", "2026-05-10") == ledger_sums([])


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"start": "2026-05-02", "end": "2026-05-01"}, "start"),
        ({"group_by": "week"}, "group_by"),
        ({"start": "2026-13-01"}, "start"),
        ({"end": "next tuesday"}, "end"),
        ({"format": "xml"}, "format"),
    ],
)
def test_it_answers_400_naming_the_bad_field(api, key_a, params, param):
    response = usage(api, key_a, **params)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_value" and param in error["message"]


def test_errors_stay_json_when_csv_is_asked_for(api, key_a):
    response = api.get("/v1/usage?group_by=week", key_a, HTTP_ACCEPT="text/csv")
    assert response.status_code == 400 and response["Content-Type"] == "application/json"
    assert response.json()["error"]["param"] == "group_by"


@pytest.mark.parametrize("ask", ["accept", "format"])
def test_it_answers_csv_with_a_header_row(api, org_a, key_a, key_row_a, price_a, ask):
    rows = [record(org_a, key_row_a, price_a, 1000, 250, 100) for _ in range(2)]
    if ask == "accept":
        response = api.get(
            "/v1/usage?group_by=key", key_a, HTTP_ACCEPT="text/csv, application/json;q=0.5"
        )
    else:
        response = usage(api, key_a, group_by="key", format="csv")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    header, *lines = list(csv.reader(io.StringIO(response.content.decode())))
    assert header == [
        "api_key_id",
        "api_key_name",
        "api_key_prefix",
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "cache_hit_ratio",
        "input_usd",
        "cached_input_usd",
        "output_usd",
        "total_usd",
        "cache_savings_usd",
    ]
    [line] = lines
    sums = ledger_sums(rows)
    identity = [str(key_row_a.id), "ci", f"hk_{key_row_a.prefix}"]
    assert line[:8] == [*identity, "2", "2000", "500", "200", "0.25"]
    assert [Decimal(v) for v in line[8:]] == [sums[name] for name in AMOUNTS]


def test_day_csv_has_one_row_per_day(api, org_a, key_a, key_row_a, price_a):
    start = datetime(2026, 7, 1, tzinfo=UTC)
    for day in (0, 0, 2):
        record(org_a, key_row_a, price_a, 10, 5, 1, at=start + timedelta(days=day, hours=5))
    response = usage(api, key_a, start="2026-07-01", end="2026-08-01", format="csv")
    table = list(csv.reader(io.StringIO(response.content.decode())))
    assert [row[:2] for row in table] == [
        ["day", "requests"],
        ["2026-07-01", "2"],
        ["2026-07-03", "1"],
    ]


def test_daily_sums_stay_exact_under_concurrent_writers(transactional_db):
    """Writers recording usage for the same org, key, model and day at once: the trigger's
    upserts on one `UsageDay` row must add every one of them."""
    org = Org.objects.create(slug="busy", name="Busy")
    key, _ = ApiKey.objects.create_key(org, "k")
    price = priced_model("busy-model", "busy", 1024).current_price()
    writers, per_writer = 6, 15
    barrier = threading.Barrier(writers)
    errors = []

    def write(offset: int) -> None:
        try:
            barrier.wait()
            for n in range(per_writer):
                with transaction.atomic():
                    record(org, key, price, 100 + offset + n, n, 7)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    [day] = UsageDay.objects.filter(org=org)
    sums = ledger_sums(UsageRecord.objects.filter(org=org))
    assert sums["requests"] == writers * per_writer
    assert {name: getattr(day, name) for name in sums} == sums


# The property: random requests, prices and price changes; reports and invoices equal the ledger.
BASE = datetime(2025, 10, 20, tzinfo=UTC)
WINDOW_S = 70 * 24 * 3600  # spans three closed months


@st.composite
def prices(draw):
    places = st.decimals(min_value=0, max_value=50, places=6, allow_nan=False)
    full = draw(places)
    cached = draw(st.decimals(min_value=0, max_value=full, places=6, allow_nan=False))
    discount = draw(st.integers(0, 100))
    return full, cached, draw(places), discount


@st.composite
def usage_request(draw):
    prompt = draw(st.integers(0, 200_000))
    return {
        "model": draw(st.integers(0, 1)),
        "key": draw(st.integers(0, 2)),
        "mode": draw(st.sampled_from(["sync", "async", "batch"])),
        "prompt": prompt,
        "cached": draw(st.integers(0, prompt)),
        "completion": draw(st.integers(0, 50_000)),
        # None: now (this month's draft invoice); else seconds after BASE.
        "at": draw(st.one_of(st.none(), st.integers(0, WINDOW_S - 1))),
        "new_price": draw(st.one_of(st.none(), prices())),
    }


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    requests=st.lists(usage_request(), min_size=1, max_size=25),
    cut=st.tuples(st.integers(0, WINDOW_S), st.integers(0, WINDOW_S)),
    delete_key=st.booleans(),
)
def test_reports_and_invoices_equal_the_ledger(api, org_a, key_a, requests, cut, delete_key):
    with transaction.atomic():
        write_and_check(api, org_a, key_a, requests, cut, delete_key)
        transaction.set_rollback(True)  # the next example starts from the same database


def write_and_check(api, org, key_secret, requests, cut, delete_key):
    models = [
        ServedModel.objects.create(id=f"prop-{n}", source="x", context_length=1024) for n in (0, 1)
    ]
    current = [
        Price.objects.create(
            model=model,
            effective_from=BASE,
            input_per_mtok=Decimal("0.6"),
            cached_input_per_mtok=Decimal("0.1"),
            output_per_mtok=Decimal("3"),
        )
        for model in models
    ]
    keys = [ApiKey.objects.get(org=org)] + [
        ApiKey.objects.create_key(org, f"k{n}")[0] for n in (1, 2)
    ]
    for index, request in enumerate(requests):
        if request["new_price"] is not None:
            full, cached, output, discount = request["new_price"]
            current[request["model"]] = Price.objects.create(
                model=models[request["model"]],
                effective_from=BASE + timedelta(seconds=index + 1),
                input_per_mtok=full,
                cached_input_per_mtok=cached,
                output_per_mtok=output,
                async_discount_percent=discount,
            )
        at = None if request["at"] is None else BASE + timedelta(seconds=request["at"])
        record(
            org,
            keys[request["key"]],
            current[request["model"]],
            request["prompt"],
            request["cached"],
            request["completion"],
            at=at,
            mode=request["mode"],
        )
    if delete_key:
        keys[2].delete()
    rows = list(UsageRecord.objects.filter(org=org).select_related("api_key"))

    # Reports over everything, per grouping: every group and the total.
    start, end = BASE - timedelta(days=1), timezone.now() + timedelta(days=1)
    group_of = {
        "day": lambda r: r.created.date().isoformat(),
        "model": lambda r: r.model,
        "key": lambda r: r.api_key_id,
    }
    field_of = {"day": "day", "model": "model", "key": "api_key_id"}
    for group_by, of in group_of.items():
        body = usage(api, key_secret, start=iso(start), end=iso(end), group_by=group_by).json()
        groups = defaultdict(list)
        for row in rows:
            groups[of(row)].append(row)
        reported = {entry[field_of[group_by]]: reported_sums(entry) for entry in body["data"]}
        assert reported == {value: ledger_sums(members) for value, members in groups.items()}
        assert reported_sums(body["total"]) == ledger_sums(rows)

    # Periods cutting through days: a random one, and the tightest around the moved rows (its
    # first and last days are partial and hold rows).
    low, high = sorted(cut)
    moved = sorted(row.created for row in rows if row.created < BASE + timedelta(seconds=WINDOW_S))
    periods = [(BASE + timedelta(seconds=low), BASE + timedelta(seconds=high))]
    if moved:
        periods.append((moved[0], moved[-1] + timedelta(microseconds=1)))
    for cut_start, cut_end in periods:
        body = usage(api, key_secret, start=iso(cut_start), end=iso(cut_end)).json()
        inside = [row for row in rows if cut_start <= row.created < cut_end]
        assert reported_sums(body["total"]) == ledger_sums(inside)

    # One invoice per month with usage; its total is the ledger's, its lines add up to it.
    invoices = Invoice.objects.for_org(org)
    months = sorted({row.created.date().replace(day=1) for row in rows}, reverse=True)
    assert [invoice.period_start for invoice in invoices] == months
    for invoice in invoices:
        month_start, month_end = month_bounds(invoice.period_start)
        in_month = [row for row in rows if month_start <= row.created < month_end]
        sums = ledger_sums(in_month)
        statement = invoice.statement()
        body = api.get(f"/v1/invoices/{invoice.id}", key_secret).json()
        assert Decimal(body["total"]) == statement.totals.total_cost == sums["total_cost"]
        assert Decimal(body["subtotal"]) == statement.subtotal == sums["total_cost"]
        assert Decimal(body["cache_savings"]) == sums["cache_savings"]
        assert body["requests"] == sums["requests"]
        assert body["status"] == ("draft" if month_end > timezone.now() else "final")
        for line in body["lines"]:
            quantity, price = line["quantity"], Decimal(line["unit_price"])
            assert Decimal(line["amount"]) == quantity * price / 1_000_000
        # Each (model, kind, unit price) once; the charged prices are the rows' prices, less
        # their discount.
        charged = {
            (line["model"], line["kind"], Decimal(line["unit_price"])) for line in body["lines"]
        }
        assert len(charged) == len(body["lines"])
        assert charged == {
            (
                row.model,
                kind,
                getattr(row.price, price_field) * (100 - row.discount_percent) / 100,
            )
            for row in in_month
            for kind, price_field, tokens in (
                ("input", "input_per_mtok", row.prompt_tokens - row.cached_tokens),
                ("cached_input", "cached_input_per_mtok", row.cached_tokens),
                ("output", "output_per_mtok", row.completion_tokens),
            )
            if tokens
        }


# The console's billing page.
@pytest.fixture
def console_a(org_a) -> Client:
    client = Client()
    client.force_login(member_of(org_a, "alice"))
    return client


@pytest.mark.parametrize("path", ["/console/billing", "/console/billing/usage.csv"])
def test_the_billing_pages_need_a_login(client, db, path):
    response = client.get(path)
    assert response.status_code == 302 and response["Location"].startswith("/console/login")


def test_the_billing_page_shows_the_orgs_month(console_a, org_a, key_row_a, price_a, org_b):
    ours = [record(org_a, key_row_a, price_a, 1000, 600, 200) for _ in range(2)]
    record(org_b, ApiKey.objects.create_key(org_b, "b")[0], price_a, 9_000_000, 0, 1)
    html = console_a.get("/console/billing").content.decode()
    sums = ledger_sums(ours)
    assert f'id="total-cost">${decimal_string(sums["total_cost"])}<' in html
    assert f'id="cache-savings">${decimal_string(sums["cache_savings"])}<' in html
    assert 'id="total-requests">2<' in html
    today = timezone.now().date().isoformat()
    assert f'data-day="{today}" data-cost="{decimal_string(sums["total_cost"])}"' in html
    assert f'<tr data-model="{price_a.model_id}">' in html
    assert f'<tr data-key="{key_row_a.id}">' in html
    assert "/console/billing/usage.csv?group_by=model&amp;month=" in html


def test_the_billing_page_csv_is_the_apis(console_a, api, org_a, key_a, key_row_a, price_a):
    record(org_a, key_row_a, price_a, 1000, 600, 200)
    month = f"{timezone.now():%Y-%m}"
    page = console_a.get(f"/console/billing/usage.csv?group_by=model&month={month}")
    assert page["Content-Type"].startswith("text/csv")
    assert page.content == usage(api, key_a, group_by="model", format="csv").content
    assert console_a.get("/console/billing?month=2026-13").status_code == 404
    assert console_a.get("/console/billing/usage.csv?group_by=week").status_code == 404
