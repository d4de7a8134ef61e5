"""Monthly invoices: drafts computed live, months finalized once, totals that are the ledger's to
the last decimal place, and nothing of another org's."""

from __future__ import annotations

import threading
from datetime import timedelta
from decimal import Decimal

import pytest
from django.db import connections
from django.test import Client
from django.utils import timezone

from controlplane.accounts.models import ApiKey, Org
from controlplane.billing.invoices import FINALIZE_AFTER, Invoice, InvoiceLine
from controlplane.billing.models import UsageRecord
from controlplane.billing.pricing import decimal_string
from controlplane.billing.reports import month_bounds
from controlplane.catalog.models import Price
from tests.controlplane.conftest import priced_model
from tests.controlplane.test_console import member_of
from tests.controlplane.test_usage_reports import ledger_sums, record


def months_ago(count: int):
    """The start of the UTC month `count` months before this one."""
    start = month_bounds(timezone.now().date())[0]
    for _ in range(count):
        start = month_bounds((start - timedelta(days=1)).date())[0]
    return start


@pytest.fixture
def key_row_a(org_a, key_a):
    return ApiKey.objects.get(org=org_a)


@pytest.fixture
def price_a(smollm2):
    return smollm2.current_price()


def invoices(api, key) -> list[dict]:
    response = api.get("/v1/invoices", key)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "list"
    return body["data"]


def test_it_lists_one_invoice_per_month_newest_first(api, org_a, key_a, key_row_a, price_a):
    two_ago, one_ago = months_ago(2), months_ago(1)
    old = [
        record(org_a, key_row_a, price_a, 100, 50, 10, at=two_ago + timedelta(days=d))
        for d in (0, 3)
    ]
    recent = [record(org_a, key_row_a, price_a, 100, 0, 10, at=one_ago + timedelta(hours=2))]
    live = [record(org_a, key_row_a, price_a, 10, 10, 1)]

    listed = invoices(api, key_a)

    assert [i["period_start"] for i in listed] == [
        f"{m:%Y-%m-%d}" for m in (months_ago(0), one_ago, two_ago)
    ]
    assert [i["status"] for i in listed] == ["draft", "final", "final"]
    for invoice, rows in zip(listed, (live, recent, old), strict=True):
        assert Decimal(invoice["total"]) == ledger_sums(rows)["total_cost"]
        assert invoice["requests"] == len(rows)
        assert invoice["period_end"] == f"{month_bounds(rows[0].created.date())[1]:%Y-%m-%d}"


def test_it_shows_a_line_per_model_kind_and_price(api, org_a, key_a, key_row_a, smollm2, price_a):
    month = months_ago(2)
    other = priced_model("other-model", "other", 4096).current_price()
    rows = [
        record(org_a, key_row_a, price_a, 1000, 600, 200, at=month + timedelta(days=1)),
        record(org_a, key_row_a, price_a, 1, 0, 1, at=month + timedelta(days=2), mode="async"),
        record(org_a, key_row_a, other, 10, 0, 0, at=month + timedelta(days=2)),
    ]
    dearer = Price.objects.create(
        model=smollm2,
        input_per_mtok=Decimal("1.234567"),
        cached_input_per_mtok=Decimal("0.2"),
        output_per_mtok=Decimal("6"),
    )
    rows.append(record(org_a, key_row_a, dearer, 7, 3, 11, at=month + timedelta(days=20)))

    [listed] = invoices(api, key_a)
    invoice = api.get(f"/v1/invoices/{listed['id']}", key_a).json()

    assert invoice == listed
    assert invoice["object"] == "invoice" and invoice["currency"] == "USD"
    assert [
        (li["model"], li["kind"], li["quantity"], li["unit_price"]) for li in invoice["lines"]
    ] == [
        ("SmolLM2-135M-Instruct", "input", 401, "0.6"),
        ("SmolLM2-135M-Instruct", "input", 4, "1.234567"),
        ("SmolLM2-135M-Instruct", "cached_input", 600, "0.1"),
        ("SmolLM2-135M-Instruct", "cached_input", 3, "0.2"),
        ("SmolLM2-135M-Instruct", "output", 201, "3"),
        ("SmolLM2-135M-Instruct", "output", 11, "6"),
        ("other-model", "input", 10, "0.6"),
    ]
    assert invoice["lines"][1]["amount"] == "0.000004938268"
    sums = ledger_sums(rows)
    # The ledger's total to its last decimal place, below a cent too; amount due in cents.
    assert invoice["total"] == invoice["subtotal"] == decimal_string(sums["total_cost"])
    assert invoice["total"] == "0.000981138268"
    assert invoice["amount_due"] == "0"
    assert invoice["cache_savings"] == decimal_string(sums["cache_savings"])


def test_the_current_month_is_a_draft_computed_on_every_read(api, org_a, key_a, key_row_a, price_a):
    record(org_a, key_row_a, price_a, 1000, 0, 0)
    [first] = invoices(api, key_a)
    assert first["status"] == "draft" and first["total"] == "0.0006"
    record(org_a, key_row_a, price_a, 0, 0, 1000)
    again = api.get(f"/v1/invoices/{first['id']}", key_a).json()
    assert again["id"] == first["id"] and again["total"] == "0.0036"
    assert not InvoiceLine.objects.exists()


def test_a_past_month_is_finalized_once(api, org_a, key_a, key_row_a, price_a):
    month = months_ago(2)
    record(org_a, key_row_a, price_a, 1000, 600, 200, at=month + timedelta(days=5))
    [first] = invoices(api, key_a)
    invoice = Invoice.objects.get(id=first["id"])
    assert invoice.status == Invoice.FINAL and invoice.total == Decimal("0.0009")
    lines = list(invoice.lines.values_list("id", "amount"))
    assert len(lines) == 3

    # A row that arrives for a finalized month changes the ledger, not the invoice.
    record(org_a, key_row_a, price_a, 1000, 0, 0, at=month + timedelta(days=6))
    assert invoices(api, key_a) == [first]
    assert api.get(f"/v1/invoices/{first['id']}", key_a).json() == first
    assert list(invoice.lines.values_list("id", "amount")) == lines
    assert Invoice.objects.filter(org=org_a).count() == 1


def test_a_month_stays_draft_until_the_grace_after_its_end(org_a, key_row_a, price_a):
    month = months_ago(2)
    record(org_a, key_row_a, price_a, 10, 0, 0, at=month + timedelta(days=1))
    month_end = month_bounds(month.date())[1]
    [invoice] = Invoice.objects.for_org(
        org_a, now=month_end + FINALIZE_AFTER - timedelta(seconds=1)
    )
    assert invoice.status == Invoice.DRAFT
    [again] = Invoice.objects.for_org(org_a, now=month_end + FINALIZE_AFTER)
    assert again.id == invoice.id and again.status == Invoice.FINAL
    assert again.finalized_at == month_end + FINALIZE_AFTER


def test_concurrent_reads_finalize_a_month_once(transactional_db):
    org = Org.objects.create(slug="racy", name="Racy")
    key, _ = ApiKey.objects.create_key(org, "k")
    price = priced_model("racy-model", "racy", 1024).current_price()
    month = months_ago(2)
    for day in range(5):
        record(org, key, price, 1000 + day, day, 10, at=month + timedelta(days=day))
    readers = 4
    barrier = threading.Barrier(readers)
    seen, errors = [], []

    def read() -> None:
        try:
            barrier.wait()
            seen.append([(i.id, i.status, i.total) for i in Invoice.objects.for_org(org)])
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=read) for _ in range(readers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    [invoice] = Invoice.objects.filter(org=org)
    assert seen == [[(invoice.id, "final", invoice.total)]] * readers
    assert invoice.total == ledger_sums(UsageRecord.objects.filter(org=org))["total_cost"]
    assert invoice.lines.count() == 3


def test_another_orgs_invoice_is_a_404(api, org_a, key_a, key_row_a, key_b, price_a):
    record(org_a, key_row_a, price_a, 10, 0, 0)
    [ours] = invoices(api, key_a)
    assert invoices(api, key_b) == []
    for invoice_id in (ours["id"], "inv_missing"):
        response = api.get(f"/v1/invoices/{invoice_id}", key_b)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "invoice_not_found"


def test_invoices_need_an_api_key(api, db):
    assert api.get("/v1/invoices").status_code == 401
    assert api.get("/v1/invoices/inv_x").status_code == 401


# The console's printable page.
def test_the_invoice_page_prints_the_invoice(org_a, key_row_a, price_a, org_b):
    month = months_ago(2)
    record(org_a, key_row_a, price_a, 1000, 600, 200, at=month + timedelta(days=5))
    [invoice] = Invoice.objects.for_org(org_a)
    client = Client()
    client.force_login(member_of(org_a, "alice"))
    html = client.get(f"/console/billing/invoices/{invoice.id}").content.decode()
    assert f'id="invoice-id">{invoice.id}<' in html
    assert 'id="invoice-total">0.0009<' in html and 'id="invoice-amount-due">0<' in html
    assert 'id="invoice-cache-savings">$0.0003<' in html
    assert html.count("<td>SmolLM2-135M-Instruct</td>") == 3  # input, cached input, output
    billing = client.get("/console/billing").content.decode()
    assert f'href="/console/billing/invoices/{invoice.id}"' in billing

    outsider = Client()
    outsider.force_login(member_of(org_b, "bob"))
    assert outsider.get(f"/console/billing/invoices/{invoice.id}").status_code == 404
    assert Client().get(f"/console/billing/invoices/{invoice.id}").status_code == 302
