"""The usage ledger: exactly one row per billed request, unique on `request_id`."""

from __future__ import annotations

from decimal import Decimal

from django.db import models

from controlplane.billing.pricing import compute_costs, cost_object
from controlplane.catalog.models import Price

MONEY = {"max_digits": 28, "decimal_places": 14}
# Prices have at most 6 decimals and are per million tokens, discounts are whole percents: 14
# places hold every cost exactly.
MONEY_QUANTUM = Decimal("1e-14")


class UsageRecordManager(models.Manager["UsageRecord"]):
    def record(self, **fields) -> UsageRecord:
        """Write the request's usage row: one INSERT.

        Call inside the transaction that settles the job, holding its row lock after checking it
        unsettled (jobs/settlement.py), so row and job change together and no other row for the
        request can exist; should one, the unique `request_id` refuses the second
        (IntegrityError) rather than bill twice."""
        record = self.build(**fields)
        record.save(force_insert=True)
        return record

    def build(
        self,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        price: Price,
        discount_percent: int = 0,
        **fields,
    ) -> UsageRecord:
        """The usage row `record` writes, with its exact costs, unsaved (for a caller that sends
        its INSERT together with other statements). `fields`: request_id, org (or org_id),
        api_key (or api_key_id), model, mode."""
        costs = compute_costs(
            prompt_tokens,
            cached_tokens,
            completion_tokens,
            price.input_per_mtok,
            price.cached_input_per_mtok,
            price.output_per_mtok,
            discount_percent,
        )
        return self.model(
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            completion_tokens=completion_tokens,
            price=price,
            discount_percent=discount_percent,
            input_cost=costs.input.quantize(MONEY_QUANTUM),
            cached_input_cost=costs.cached_input.quantize(MONEY_QUANTUM),
            output_cost=costs.output.quantize(MONEY_QUANTUM),
            total_cost=costs.total.quantize(MONEY_QUANTUM),
            cache_savings=costs.cache_savings.quantize(MONEY_QUANTUM),
            **fields,
        )


class UsageRecord(models.Model):
    """Tokens and exact costs of one request, at the prices it was charged (`price`)."""

    request_id = models.CharField(max_length=64, unique=True)
    # Neither it nor `created` is indexed alone: usage_org_created leads with it, and nothing
    # reads the ledger by time across orgs.
    org = models.ForeignKey(
        "accounts.Org", on_delete=models.PROTECT, related_name="usage", db_index=False
    )
    api_key = models.ForeignKey(
        "accounts.ApiKey", on_delete=models.SET_NULL, null=True, related_name="usage"
    )
    model = models.CharField(max_length=200)
    mode = models.CharField(max_length=8)
    prompt_tokens = models.PositiveIntegerField()
    cached_tokens = models.PositiveIntegerField()
    completion_tokens = models.PositiveIntegerField()
    price = models.ForeignKey(Price, on_delete=models.PROTECT, related_name="usage")
    # The price's async discount when it applied (async jobs, batch lines), else 0; the costs
    # below are after it.
    discount_percent = models.PositiveSmallIntegerField(default=0)
    input_cost = models.DecimalField(**MONEY)
    cached_input_cost = models.DecimalField(**MONEY)
    output_cost = models.DecimalField(**MONEY)
    total_cost = models.DecimalField(**MONEY)
    cache_savings = models.DecimalField(**MONEY)
    created = models.DateTimeField(auto_now_add=True)

    objects = UsageRecordManager()

    class Meta:
        # Reports read the ledger by org and time (the partial days at a period's edges).
        indexes = [models.Index(fields=["org", "created"], name="usage_org_created")]

    def cost_object(self) -> dict[str, str]:
        """The costs as decimal strings (USD), as the API shows them."""
        return cost_object(self)
