"""Usage reports: an org's ledger over a period, totalled per UTC day, model or API key.

A period is `[start, end)` in UTC, `end` exclusive, so consecutive periods never count a row
twice. Its whole days are summed from `UsageDay` (kept exact by a database trigger) and the
partial days at its edges from the ledger itself, so any instant is a valid bound and a month
costs the same however many requests it held. Every amount is a Decimal sum of
the ledger's own amounts, never recomputed from prices: a report, an invoice and the sum of the
UsageRecords agree to the last of their 14 decimal places.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from dataclasses import astuple, dataclass, field, fields
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal

from django.db.models import Count, QuerySet, Sum, Value
from django.db.models.functions import Coalesce, TruncDate

from controlplane.accounts.models import ApiKey, Org
from controlplane.billing.ledger import UsageRecord
from controlplane.billing.pricing import cost_object
from controlplane.billing.usage_days import NO_KEY, UsageDay

GROUPINGS = ("day", "model", "key")
ZERO = Decimal(0)


@dataclass(frozen=True)
class UsageTotals:
    """Request count, token counts and exact USD amounts of some ledger rows."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    input_cost: Decimal = ZERO
    cached_input_cost: Decimal = ZERO
    output_cost: Decimal = ZERO
    total_cost: Decimal = ZERO
    cache_savings: Decimal = ZERO

    def __add__(self, other: UsageTotals) -> UsageTotals:
        return UsageTotals(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    @property
    def cache_hit_ratio(self) -> float:
        """Cached over prompt tokens (0 without prompt tokens): a share, not money."""
        return round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0

    def cost_object(self) -> dict[str, str]:
        """The amounts as decimal strings, in the shape of a job's `cost`."""
        return cost_object(self)

    def as_object(self) -> dict:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "cache_hit_ratio": self.cache_hit_ratio,
            "cost": self.cost_object(),
        }


SUMMED = [f.name for f in fields(UsageTotals) if f.name != "requests"]


def summed(
    rows: QuerySet, group: Iterable[str], ledger: bool
) -> Iterable[tuple[tuple, UsageTotals]]:
    """(group values, totals) per group of `rows`, `UsageDay` rows or, with `ledger`,
    UsageRecords (one request each), grouped by the fields or annotations named in `group`."""
    group = list(group)
    requests = Count("id") if ledger else Sum("requests")
    sums = rows.values(*group).annotate(
        n_requests=requests, **{f"sum_{name}": Sum(name) for name in SUMMED}
    )
    for row in sums.order_by():
        yield (
            tuple(row[name] for name in group),
            UsageTotals(row["n_requests"], *(row[f"sum_{name}"] for name in SUMMED)),
        )


def midnight(day: date) -> datetime:
    return datetime.combine(day, time(), tzinfo=UTC)


def month_bounds(day: date) -> tuple[datetime, datetime]:
    """The UTC month holding `day`, as `[start, end)`."""
    first = day.replace(day=1)
    following = (first + timedelta(days=32)).replace(day=1)
    return midnight(first), midnight(following)


def split_period(start: datetime, end: datetime) -> tuple[tuple[date, date] | None, list]:
    """The whole UTC days inside `[start, end)`, as `[first, last)` or None, and the ranges of
    instants at its edges that cut through a day."""
    first_whole = (
        midnight(start.date())
        if start == midnight(start.date())
        else midnight(start.date() + timedelta(days=1))
    )
    last_whole = midnight(end.date())
    if first_whole >= last_whole:
        return None, [(start, end)] if start < end else []
    edges = [(a, b) for a, b in ((start, first_whole), (last_whole, end)) if a < b]
    return (first_whole.date(), last_whole.date()), edges


def usage_days(org: Org, first: date, last: date) -> QuerySet:
    """The org's `UsageDay` rows from `first` to `last` (exclusive)."""
    return UsageDay.objects.filter(org=org, day__gte=first, day__lt=last)


# What each grouping reads from `UsageDay` and from the ledger (annotated to the same names).
_DAY_GROUP = {"day": "day", "model": "model", "key": "key_id"}
_LEDGER_GROUP = {
    "day": TruncDate("created", tzinfo=UTC),
    "model": None,
    "key": Coalesce("api_key_id", Value(NO_KEY)),
}


def period_totals(org: Org, start: datetime, end: datetime, group_by: str) -> dict:
    """{group value: UsageTotals} of the org's usage in `[start, end)`, grouped by `group_by`
    (one of GROUPINGS): whole days from `UsageDay`, edges from the ledger."""
    name = _DAY_GROUP[group_by]
    whole_days, edges = split_period(start, end)
    parts = []
    if whole_days is not None:
        parts.append(summed(usage_days(org, *whole_days), [name], ledger=False))
    for edge_start, edge_end in edges:
        rows = UsageRecord.objects.filter(org=org, created__gte=edge_start, created__lt=edge_end)
        if _LEDGER_GROUP[group_by] is not None:
            rows = rows.annotate(**{name: _LEDGER_GROUP[group_by]})
        parts.append(summed(rows, [name], ledger=True))
    totals: dict = {}
    for part in parts:
        for (value,), part_totals in part:
            totals[value] = totals.get(value, UsageTotals()) + part_totals
    return {value: t for value, t in totals.items() if t.requests}


@dataclass
class UsageReport:
    """An org's usage in `[start, end)`, one row per group, ordered by group, and the total."""

    org: Org
    start: datetime
    end: datetime
    group_by: str
    rows: list[tuple[object, UsageTotals]]
    total: UsageTotals
    keys: dict[int, ApiKey] = field(default_factory=dict)

    @classmethod
    def build(cls, org: Org, start: datetime, end: datetime, group_by: str) -> UsageReport:
        totals = period_totals(org, start, end, group_by)
        rows = sorted(totals.items(), key=lambda item: item[0])
        total = sum((t for _, t in rows), UsageTotals())
        keys = {}
        if group_by == "key":
            keys = ApiKey.objects.filter(org=org, id__in=list(totals)).in_bulk()
        return cls(org, start, end, group_by, rows, total, keys)

    def group_fields(self, value) -> dict:
        """What identifies a row's group: its day, model, or key (id, name and public prefix;
        all null for usage whose key was deleted)."""
        if self.group_by == "day":
            return {"day": value.isoformat()}
        if self.group_by == "model":
            return {"model": value}
        key = self.keys.get(value)
        return {
            "api_key_id": key.id if key else None,
            "api_key_name": key.name if key else None,
            "api_key_prefix": f"hk_{key.prefix}" if key else None,
        }

    def as_object(self) -> dict:
        return {
            "object": "usage_report",
            "start": self.start.isoformat().replace("+00:00", "Z"),
            "end": self.end.isoformat().replace("+00:00", "Z"),
            "group_by": self.group_by,
            "data": [{**self.group_fields(v), **t.as_object()} for v, t in self.rows],
            "total": self.total.as_object(),
        }

    def as_csv(self) -> str:
        """A header row, then one row per group; amounts in USD as exact decimal strings. No
        total row, so a spreadsheet's column sums are the totals."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow([*GROUP_COLUMNS[self.group_by], *CSV_COLUMNS])
        for value, totals in self.rows:
            cost = totals.cost_object()
            writer.writerow(
                [
                    *self.group_fields(value).values(),
                    totals.requests,
                    totals.prompt_tokens,
                    totals.cached_tokens,
                    totals.completion_tokens,
                    totals.cache_hit_ratio,
                    cost["input"],
                    cost["cached_input"],
                    cost["output"],
                    cost["total"],
                    cost["cache_savings"],
                ]
            )
        return out.getvalue()


GROUP_COLUMNS = {
    "day": ["day"],
    "model": ["model"],
    "key": ["api_key_id", "api_key_name", "api_key_prefix"],
}
CSV_COLUMNS = [
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
