"""The console's billing page in Chromium, on the production stack: after real requests through
the `openai` SDK (sync and async, one hitting the prefix cache), the numbers on the page are the
ledger's, read from the database by the test."""

from __future__ import annotations

from decimal import Decimal

import openai
import pytest
from django.contrib.auth import get_user_model

from controlplane.accounts.models import Membership, Org
from controlplane.billing.models import UsageRecord
from controlplane.billing.pricing import decimal_string
from tests.e2e.browser import open_page, recorded, sign_in
from tests.e2e.stack import ROOT
from tests.e2e.user_path import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

SCREENSHOT = ROOT / "tests" / "artifacts" / "console-billing.png"
SYSTEM = "You review code. Answer in one short sentence. " * 2  # shared: the cache serves it


def test_the_billing_page_shows_the_ledger(stack, tiny_model, acme_key, browser_log):
    org = Org.objects.get(slug="acme")
    org.monthly_budget_usd = Decimal("1.50")
    org.save()
    user = get_user_model().objects.create_user("alice", password="alice-password")
    Membership.objects.create(org=org, user=user, role="owner")
    stack.start_node(tiny_model.id, "node-a")
    stack.wait_ready(tiny_model.id, nodes=1, api_key=acme_key)

    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=acme_key, max_retries=0)
    for index, queue in enumerate([False, False, True]):
        client.chat.completions.create(
            model=tiny_model.id,
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"change {index}"},
            ],
            max_tokens=6,
            temperature=0,
            extra_body={"queue": True} if queue else None,
        )
    wait_for(lambda: UsageRecord.objects.filter(org=org).count() == 3, what="three usage rows")
    rows = list(UsageRecord.objects.filter(org=org))
    total = sum((r.total_cost for r in rows), Decimal(0))
    savings = sum((r.cache_savings for r in rows), Decimal(0))
    assert savings > 0, "no request hit the prefix cache"
    assert any(r.discount_percent for r in rows) is False  # the test catalog has no discount

    with open_page(browser_log) as page:
        check_page(page, stack, tiny_model.id, total, savings, rows, browser_log)


def check_page(page, stack, model_id, total, savings, rows, browser_log) -> None:
    with recorded(page, SCREENSHOT, browser_log, stack.outputs):
        sign_in(page, stack.url, "/console/billing", "alice", "alice-password")

        text = page.inner_text
        assert text("#total-cost") == f"${decimal_string(total)}"
        assert text("#total-requests") == "3"
        assert text("#cache-savings") == f"${decimal_string(savings)}"
        assert text("#cached-tokens") == str(sum(r.cached_tokens for r in rows))
        assert text("#prompt-tokens") == str(sum(r.prompt_tokens for r in rows))
        model_row = f'#by-model tr[data-model="{model_id}"]'
        assert text(f"{model_row} td.cost") == decimal_string(total)
        # The chart's bars add up to the month's spend.
        bars = page.locator("#spend-chart rect.bar").evaluate_all(
            "bars => bars.map(bar => bar.dataset.cost)"
        )
        assert sum(Decimal(cost) for cost in bars) == total
        # Budget: every request settled, so all of it is spent and nothing reserved.
        assert text("#budget-limit") == "$1.5"
        assert text("#budget-spent") == f"${decimal_string(total)}"
        assert text("#budget-reserved") == "$0"
        # This month's draft invoice totals the ledger.
        assert text("#invoices td.total") == decimal_string(total)
