"""Daily usage totals, kept by the database beside the ledger, so reports over a month read a
few hundred rows instead of a million.

One `UsageDay` row holds the sums of an org's usage rows on one UTC day for one model, key,
price and mode. A trigger on the ledger's table (migration 0002) adds each inserted row to its
day and moves an updated or deleted one, inside the writer's own transaction: the sums are
exactly the committed ledger's, whoever writes it (the worker's `record_completion`, a batch, an
operator in psql), and concurrent writers to the same day queue on that row's lock instead of
losing an addition. Only whole days come from here; reports read the ledger itself for the part
of a range that cuts through a day (controlplane/billing/reports.py).

Summing a month of ledger rows is the cost of a report (an index covering the summed columns
does not help), so reports read these rows instead (bench/billing.py; docs/performance.md).
"""

from __future__ import annotations

from django.db import models

# Sums of many ledger amounts (28 digits, 14 places): room for ten thousand times more.
MONEY_SUM = {"max_digits": 32, "decimal_places": 14}
# The key column holds this for usage whose key was deleted (the ledger's api_key is NULL then):
# a NULL would make every such row distinct to the unique constraint the trigger upserts on.
NO_KEY = 0


class UsageDay(models.Model):
    """An org's usage on one UTC day for one model, key, price and mode: the sums of its ledger
    rows. Written only by the database trigger; read by reports and invoices."""

    # Indexed as the unique constraint's first column.
    org = models.ForeignKey(
        "accounts.Org", on_delete=models.CASCADE, related_name="+", db_index=False
    )
    day = models.DateField()
    model = models.CharField(max_length=200)
    # Plain ids, not foreign keys: the ledger already holds those constraints, and the trigger's
    # upsert stays one statement.
    key_id = models.BigIntegerField()
    price_id = models.BigIntegerField()
    mode = models.CharField(max_length=8)
    requests = models.BigIntegerField()
    prompt_tokens = models.BigIntegerField()
    cached_tokens = models.BigIntegerField()
    completion_tokens = models.BigIntegerField()
    input_cost = models.DecimalField(**MONEY_SUM)
    cached_input_cost = models.DecimalField(**MONEY_SUM)
    output_cost = models.DecimalField(**MONEY_SUM)
    total_cost = models.DecimalField(**MONEY_SUM)
    cache_savings = models.DecimalField(**MONEY_SUM)

    class Meta:
        constraints = [
            # The trigger's ON CONFLICT target; it also serves every read (org, then days).
            models.UniqueConstraint(
                fields=["org", "day", "model", "key_id", "price_id", "mode"], name="one_usage_day"
            )
        ]
