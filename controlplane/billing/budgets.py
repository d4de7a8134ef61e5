"""Monthly budgets per org and per key: reserved at admission, settled at completion.

A budget is a spend limit in USD for a calendar month (UTC), on an org
(`Org.monthly_budget_usd`) and on a key (`ApiKey.monthly_budget_usd`); null is no limit. Each
limited scope has a `SpendCounter` row per month holding what settled (`spent`) and what is
reserved by requests still open (`reserved`).

Admission reserves the request's maximum cost (every prompt token at the input price, plus
`max_tokens` at the output price, less the async discount where it applies) in one conditional
UPDATE of the limited scopes' counters (per scope `reserved += cost WHERE spent + reserved + cost
<= limit`), in the transaction that writes the job: PostgreSQL's row locks serialise concurrent
reservations, so they can never together pass the limit, and a refused one leaves no job and no
reservation.
Every terminal transition of the job then settles once, in its own transaction: the real cost
(zero for a job that never ran) moves into `spent` and the whole reservation is released. A
reservation and its settlement belong to the month the job was admitted in.

A counter is created the first time its scope is limited in a month, starting from what the
ledger holds for that scope and month; settlement keeps it up to date from then on (every
settlement updates the org's and the key's counters for the month, limited or not, in one
statement that touches no row when there is none). A request that settles while a counter is
being created may be missing from it: budgets are exact from the counter on.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime
from decimal import Decimal
from typing import Any

from django.db import connection, models
from django.db.models import Sum
from django.utils import timezone

from controlplane.billing.ledger import UsageRecord
from controlplane.billing.pricing import decimal_string
from controlplane.billing.reports import month_bounds

MONEY = {"max_digits": 28, "decimal_places": 14}
# (org id, scope, month) whose counter this process has seen exist: reservations skip the check.
_known_counters: set[tuple[int, str, date]] = set()


def month_of(when: datetime) -> date:
    """The first day of `when`'s month, in UTC."""
    when = timezone.localtime(when, timezone=timezone.get_fixed_timezone(0))
    return when.date().replace(day=1)


def key_scope(api_key_id: int | None) -> str:
    return f"key:{api_key_id}"


ORG_SCOPE = "org"


class BudgetExceeded(Exception):
    """A reservation that does not fit the budget of `scope`."""

    def __init__(self, scope: str, limit: Decimal, used: Decimal, cost: Decimal) -> None:
        whose = "the organization's" if scope == ORG_SCOPE else "this API key's"
        super().__init__(
            f"This request may cost up to ${decimal_string(cost)}, which does not fit {whose} "
            f"monthly budget of ${decimal_string(limit)} (${decimal_string(used)} spent or "
            "reserved this month). Lower max_tokens, or raise the budget."
        )
        self.scope = scope


class SpendCounter(models.Model):
    """One limited scope's spend in one month: settled, and reserved by open requests."""

    org = models.ForeignKey("accounts.Org", on_delete=models.CASCADE, related_name="+")
    scope = models.CharField(max_length=32)  # "org" or "key:<id>"
    month = models.DateField()
    spent = models.DecimalField(**MONEY, default=Decimal(0))
    reserved = models.DecimalField(**MONEY, default=Decimal(0))

    class Meta:
        app_label = "billing"
        constraints = [
            models.UniqueConstraint(fields=["org", "scope", "month"], name="one_counter_a_month")
        ]


@dataclass(frozen=True)
class Reservation:
    """What admission took: `cost` in each of `scopes`."""

    cost: Decimal
    scopes: list[str]


def limited_scopes(org, api_key) -> list[tuple[str, Decimal]]:
    """The scopes of a request that have a budget, with their limits."""
    scopes = []
    if org.monthly_budget_usd is not None:
        scopes.append((ORG_SCOPE, org.monthly_budget_usd))
    if api_key is not None and api_key.monthly_budget_usd is not None:
        scopes.append((key_scope(api_key.pk), api_key.monthly_budget_usd))
    return scopes


def reserve(org, api_key, cost: Decimal, now: datetime) -> Reservation:
    """Reserve `cost` in every limited scope, inside the caller's transaction (which must also
    write the job): one UPDATE of the scopes' counters, each taken only if the cost fits its
    limit. Raises BudgetExceeded when a scope refuses, having given back what the others took."""
    month = month_of(now)
    scopes = limited_scopes(org, api_key)
    if not scopes:
        return Reservation(Decimal(0), [])
    for scope, _ in scopes:
        if (org.pk, scope, month) not in _known_counters:
            month_counter(org, scope, month)
            _known_counters.add((org.pk, scope, month))
    taken = _take(org.pk, month, scopes, cost)
    if len(taken) < len(scopes):
        _give_back(org.pk, month, taken, cost)
        scope, limit = next((s, limit) for s, limit in scopes if s not in taken)
        # Gone since this process saw it (deleted by hand)? It is created afresh next time.
        _known_counters.discard((org.pk, scope, month))
        counter = month_counter(org, scope, month)
        raise BudgetExceeded(scope, limit, counter.spent + counter.reserved, cost)
    return Reservation(cost, [scope for scope, _ in scopes])


# The budget statements are written out: they run on every admission and settlement, where the
# ORM's compilation of the same UPDATE cost more than the database's round trip. Amounts are
# passed as text and cast, which PostgreSQL and SQLite both read exactly.
_TABLE = "billing_spendcounter"
_AMOUNT = "CAST(%s AS NUMERIC)"


def _take(org_id: int, month: date, scopes: list[tuple[str, Decimal]], cost: Decimal) -> set:
    """Add `cost` to the reservations of each scope it fits; the scopes that took it. One
    conditional UPDATE: the row locks serialise concurrent reservations of a scope."""
    fits = " OR ".join(
        f"(scope = %s AND spent + reserved + {_AMOUNT} <= {_AMOUNT})" for _ in scopes
    )
    params = [str(cost), org_id, _month_value(month)]
    for scope, limit in scopes:
        params += [scope, str(cost), str(limit)]
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {_TABLE} SET reserved = reserved + {_AMOUNT} "
            f"WHERE org_id = %s AND month = %s AND ({fits}) RETURNING scope",
            params,
        )
        return {row[0] for row in cursor.fetchall()}


def _give_back(org_id: int, month: date, scopes: set, cost: Decimal) -> None:
    if not scopes:
        return
    marks = ", ".join(["%s"] * len(scopes))
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {_TABLE} SET reserved = reserved - {_AMOUNT} "
            f"WHERE org_id = %s AND month = %s AND scope IN ({marks})",
            [str(cost), org_id, _month_value(month), *sorted(scopes)],
        )


def _month_value(month: date):
    return connection.ops.adapt_datefield_value(month)


def settle(job, cost: Decimal) -> None:
    """The job's terminal transition, inside its transaction: add `cost` to the month's counters
    of its org and key, and release what it reserved. Called once per job. One UPDATE, which
    touches no row for a scope without a counter."""
    with connection.cursor() as cursor:
        for statement in settle_statements([(job, cost)]):
            cursor.execute(*statement)


def settle_statements(settled: list[tuple[Any, Decimal]]) -> list[tuple[str, list]]:
    """The UPDATEs that settle several `(job, cost)` at once: one per org, month, key and
    reserved scopes, with their costs and reservations added up (a settling transaction of many
    jobs of one org updates its counter rows once, not once per job), in a fixed order, as
    every settling transaction takes the rows' locks."""
    groups: dict[tuple, list[Decimal]] = {}
    for job, cost in settled:
        released = job.reserved_cost or Decimal(0)
        if not cost and not released:
            continue
        scopes = (ORG_SCOPE, key_scope(job.api_key_id))
        reserved_here = tuple(s for s in (job.budget_scopes or []) if s in scopes) or ("",)
        group = groups.setdefault(
            (job.org_id, month_of(job.created), scopes, reserved_here), [Decimal(0), Decimal(0)]
        )
        group[0] += cost
        group[1] += released
    statements = []
    for (org_id, month, scopes, reserved_here), (cost, released) in sorted(groups.items()):
        marks = ", ".join(["%s"] * len(reserved_here))
        statements.append(
            (
                f"UPDATE {_TABLE} SET spent = spent + {_AMOUNT}, reserved = reserved - "
                f"CASE WHEN scope IN ({marks}) THEN {_AMOUNT} ELSE 0 END "
                "WHERE org_id = %s AND month = %s AND scope IN (%s, %s)",
                [
                    str(cost),
                    *reserved_here,
                    str(released),
                    org_id,
                    _month_value(month),
                    *scopes,
                ],
            )
        )
    return statements


def usage_this_month(org, scope: str, now: datetime | None = None) -> dict[str, str] | None:
    """The month's counter as the API shows it: spent and reserved; None without one."""
    counter = SpendCounter.objects.filter(
        org=org, scope=scope, month=month_of(now or timezone.now())
    ).first()
    if counter is None:
        return None
    return {"spent": decimal_string(counter.spent), "reserved": decimal_string(counter.reserved)}


def month_counter(org, scope: str, month: date) -> SpendCounter:
    """The scope's counter for `month`, created from the ledger the first time."""
    counter = SpendCounter.objects.filter(org=org, scope=scope, month=month).first()
    if counter is not None:
        return counter
    counter, _ = SpendCounter.objects.get_or_create(
        org=org, scope=scope, month=month, defaults={"spent": _ledger_spend(org, scope, month)}
    )
    return counter


def _ledger_spend(org, scope: str, month: date) -> Decimal:
    start, end = month_bounds(month)
    rows = UsageRecord.objects.filter(org=org, created__gte=start, created__lt=end)
    if scope != ORG_SCOPE:
        rows = rows.filter(api_key_id=int(scope.removeprefix("key:")))
    return rows.aggregate(total=Sum("total_cost"))["total"] or Decimal(0)
