"""Monthly invoices: one per org and UTC month with usage.

A month's invoice is a draft, computed from the ledger on every read, until FINALIZE_AFTER past
the month's end; the first read after that finalizes it: its lines and totals are written once
and never change (a ledger row that arrives later for that month is in reports, not on the
invoice). The grace covers a completion stamped in the month's last instant whose transaction
commits just after it, and clocks that differ by less than that.

Lines are one per model, token kind and unit price: a month that charged a model at two prices
has a line for each. A line's amount is the ledger's sum, never recomputed from a price, and its
unit price is what that amount charged per million tokens (so a discount the ledger applied shows
as the price actually paid). The total is the sum of the ledger's `total_cost` for the org and
month, exactly; `amount_due` is that total rounded to cents, for payment only.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import date, timedelta
from decimal import ROUND_HALF_UP, Decimal

from django.db import models, transaction
from django.utils import timezone

from controlplane.api.responses import epoch_seconds
from controlplane.billing.pricing import PER_MILLION, decimal_string
from controlplane.billing.reports import UsageTotals, month_bounds, summed, usage_days
from controlplane.billing.usage_days import MONEY_SUM, UsageDay

FINALIZE_AFTER = timedelta(hours=1)
KINDS = ("input", "cached_input", "output")
CENT = Decimal("0.01")


def new_invoice_id() -> str:
    return f"inv_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class Line:
    """Tokens of one kind of one model charged at one unit price (USD per 1M tokens)."""

    model: str
    kind: str
    unit_price: Decimal
    quantity: int
    amount: Decimal

    def as_object(self) -> dict:
        return {
            "model": self.model,
            "kind": self.kind,
            "quantity": self.quantity,
            "unit_price": decimal_string(self.unit_price),
            "unit": "USD per 1M tokens",
            "amount": decimal_string(self.amount),
        }


@dataclass(frozen=True)
class Statement:
    """What an invoice charges: its lines, and the totals of the ledger rows behind them."""

    lines: list[Line]
    totals: UsageTotals

    @property
    def subtotal(self) -> Decimal:
        return sum((line.amount for line in self.lines), Decimal(0))


def month_statement(org, month: date) -> Statement:
    """The org's charges in the UTC month starting on `month`, from its daily sums."""
    start, end = month_bounds(month)
    by_price = summed(
        usage_days(org, start.date(), end.date()), ["model", "price_id", "mode"], ledger=False
    )
    totals = UsageTotals()
    amounts: dict[tuple[str, str, Decimal], list] = {}
    for (model, _price, _mode), group in by_price:
        totals += group
        charged = {
            "input": (group.prompt_tokens - group.cached_tokens, group.input_cost),
            "cached_input": (group.cached_tokens, group.cached_input_cost),
            "output": (group.completion_tokens, group.output_cost),
        }
        for kind, (quantity, amount) in charged.items():
            if not quantity:
                continue  # no tokens of this kind: the ledger charged nothing for it
            unit_price = (amount * PER_MILLION / quantity).normalize()
            line = amounts.setdefault((model, kind, unit_price), [0, Decimal(0)])
            line[0] += quantity
            line[1] += amount
    order = sorted(amounts, key=lambda key: (key[0], KINDS.index(key[1]), key[2]))
    lines = [Line(model, kind, price, *amounts[model, kind, price]) for model, kind, price in order]
    return Statement(lines, totals)


class InvoiceManager(models.Manager["Invoice"]):
    def for_org(self, org, now=None) -> list[Invoice]:
        """The org's invoices, newest month first: one for every month with usage, created on
        this read where missing, and finalized where due."""
        now = now or timezone.now()
        last_final = self.filter(org=org, status=Invoice.FINAL).order_by("-period_start").first()
        # Every month up to the last final one has had its invoice since that one was made.
        since = month_bounds(last_final.period_start)[1].date() if last_final else date.min
        months = UsageDay.objects.filter(org=org, day__gte=since, requests__gt=0).dates(
            "day", "month"
        )
        for month in months:
            invoice, _ = self.get_or_create(org=org, period_start=month)
            invoice.finalize_if_due(now)
        return list(self.filter(org=org).order_by("-period_start"))


class Invoice(models.Model):
    """An org's invoice for one UTC month (`period_start` is its first day)."""

    DRAFT, FINAL = "draft", "final"
    STATUSES = [(DRAFT, "Draft"), (FINAL, "Final")]

    id = models.CharField(primary_key=True, max_length=40, default=new_invoice_id)
    org = models.ForeignKey("accounts.Org", on_delete=models.PROTECT, related_name="invoices")
    period_start = models.DateField()
    status = models.CharField(max_length=8, choices=STATUSES, default=DRAFT)
    # Written when final; a draft's are computed on read.
    requests = models.BigIntegerField(null=True)
    total = models.DecimalField(null=True, **MONEY_SUM)
    cache_savings = models.DecimalField(null=True, **MONEY_SUM)
    created = models.DateTimeField(auto_now_add=True)
    finalized_at = models.DateTimeField(null=True)

    objects = InvoiceManager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["org", "period_start"], name="one_invoice_per_month")
        ]

    @property
    def period_end(self) -> date:
        return month_bounds(self.period_start)[1].date()

    def finalize_if_due(self, now) -> None:
        """Finalize a draft whose month ended FINALIZE_AFTER ago: write its lines and totals,
        once. The conditional UPDATE claims it; a concurrent reader's UPDATE waits on this row's
        lock, then matches nothing, and reads what this one wrote."""
        if self.status == self.FINAL or now < month_bounds(self.period_start)[1] + FINALIZE_AFTER:
            return
        with transaction.atomic():
            claimed = Invoice.objects.filter(pk=self.pk, status=self.DRAFT).update(
                status=self.FINAL, finalized_at=now
            )
            if claimed:
                statement = month_statement(self.org, self.period_start)
                InvoiceLine.objects.bulk_create(
                    InvoiceLine(
                        invoice=self,
                        model=line.model,
                        kind=line.kind,
                        unit_price=line.unit_price,
                        quantity=line.quantity,
                        amount=line.amount,
                    )
                    for line in statement.lines
                )
                Invoice.objects.filter(pk=self.pk).update(
                    requests=statement.totals.requests,
                    total=statement.totals.total_cost,
                    cache_savings=statement.totals.cache_savings,
                )
        self.refresh_from_db()

    def statement(self) -> Statement:
        """The written lines and totals of a final invoice; the live ones of a draft."""
        if self.status == self.DRAFT:
            return month_statement(self.org, self.period_start)
        lines = [
            Line(row.model, row.kind, row.unit_price, row.quantity, row.amount)
            for row in self.lines.order_by("id")
        ]
        totals = UsageTotals(
            requests=self.requests, total_cost=self.total, cache_savings=self.cache_savings
        )
        return Statement(lines, totals)

    def as_object(self, statement: Statement | None = None) -> dict:
        statement = statement or self.statement()
        total = statement.totals.total_cost
        return {
            "id": self.id,
            "object": "invoice",
            "status": self.status,
            "currency": "USD",
            "period_start": self.period_start.isoformat(),
            "period_end": self.period_end.isoformat(),
            "requests": statement.totals.requests,
            "lines": [line.as_object() for line in statement.lines],
            "subtotal": decimal_string(statement.subtotal),
            "total": decimal_string(total),
            "amount_due": decimal_string(total.quantize(CENT, rounding=ROUND_HALF_UP)),
            "cache_savings": decimal_string(statement.totals.cache_savings),
            "created": epoch_seconds(self.created),
            "finalized_at": epoch_seconds(self.finalized_at),
        }


class InvoiceLine(models.Model):
    """One written line of a final invoice."""

    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    model = models.CharField(max_length=200)
    kind = models.CharField(max_length=16)
    # USD per 1M tokens: a ledger amount over its tokens, exact (see the module's docstring).
    unit_price = models.DecimalField(max_digits=40, decimal_places=20)
    quantity = models.BigIntegerField()
    amount = models.DecimalField(**MONEY_SUM)
