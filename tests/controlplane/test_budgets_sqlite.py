"""Budgets on SQLite (embedded mode): the reservation and settlement statements are written out
by hand (billing/budgets.py), so they run here on the database they would meet in `make run`,
in a process of its own without DATABASE_URL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from decimal import Decimal
from django.db import transaction
from django.utils import timezone
from controlplane.accounts.models import ApiKey, Org
from controlplane.billing import budgets
from controlplane.jobs.models import Job

org = Org.objects.create(slug="o", name="o", monthly_budget_usd=Decimal("1.5"))
key, _ = ApiKey.objects.create_key(org, "k")
key.monthly_budget_usd = Decimal("0.7")
key.save()
with transaction.atomic():
    first = budgets.reserve(org, key, Decimal("0.5"), timezone.now())
refused = None
try:
    with transaction.atomic():
        budgets.reserve(org, key, Decimal("0.5"), timezone.now())
except budgets.BudgetExceeded as exceeded:
    refused = exceeded.scope
def counters():
    return {c.scope: [str(c.spent), str(c.reserved)] for c in budgets.SpendCounter.objects.all()}
after_refusal = counters()
job = Job(org=org, api_key=key, created=timezone.now(), reserved_cost=first.cost,
          budget_scopes=first.scopes)
budgets.settle(job, Decimal("0.125"))
print(json.dumps({"scopes": first.scopes, "refused": refused, "after_refusal": after_refusal,
                  "settled": counters(), "key": f"key:{key.pk}"}))
"""


def test_reservation_refusal_and_settlement_on_sqlite(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env |= {"DJANGO_SETTINGS_MODULE": "controlplane.settings", "HEARTH_DATA_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    key = result["key"]
    assert result["scopes"] == ["org", key]
    assert result["refused"] == key  # 0.5 + 0.5 passes the key's 0.7, not the org's 1.5
    # The org's reservation, taken by the same statement, was given back.
    assert {s: float(r) for s, (_, r) in result["after_refusal"].items()} == {"org": 0.5, key: 0.5}
    assert {s: (float(spent), float(r)) for s, (spent, r) in result["settled"].items()} == {
        "org": (0.125, 0.0),
        key: (0.125, 0.0),
    }
