"""The dashboard's figures: an org's usage, latency and errors over the last hour, 24 hours and
30 days, each window cut into buckets (minutes, hours, days) for its charts.

A window ends now and starts at the start of its first bucket, so its buckets add up to it
exactly: the last hour is the current minute and the 59 before it, the last 24 hours the current
hour and the 23 before, the last 30 days today and the 29 days before (UTC).

- Usage is the ledger's, never recomputed: the 30 days are a `UsageReport` by day (whole days
  from the UsageDay rollup, today from the ledger), the hour and the day are ledger rows summed
  per minute and per hour by the database (`reports.summed`, over the ledger's (org, created)
  index: a day holds a thirtieth of a month's rows).
- Latency: p50 and p95 of TTFT, time per output token and queue wait of the jobs settled in the
  window (by `finished_at`), interpolated as PostgreSQL's `percentile_cont`: in SQL there, from
  the index `job_org_finished` alone (a month of job rows is hundreds of MB), here on SQLite.
- Errors: failed and expired jobs by their code, and the API's error responses to the org's
  requests (gateway ApiErrorCount) by status and code.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import connection
from django.db.models import Case, CharField, Count, F, Q, Sum, When
from django.db.models.functions import Trunc

from controlplane.accounts.models import Org
from controlplane.billing.models import UsageRecord
from controlplane.billing.reports import UsageReport, UsageTotals, midnight, summed
from controlplane.gateway.models import ApiErrorCount
from controlplane.jobs.models import Job

# name: (label, bucket unit, bucket length, buckets)
WINDOWS = {
    "hour": ("Last hour", "minute", timedelta(minutes=1), 60),
    "day": ("Last 24 hours", "hour", timedelta(hours=1), 24),
    "month": ("Last 30 days", "day", timedelta(days=1), 30),
}
LATENCIES = ("ttft_s", "tpot_s", "queue_wait_s")
QUANTILES = (0.5, 0.95)


@dataclass(frozen=True)
class Window:
    """`[start, end)`, cut into `buckets` (their starts) of one `unit`."""

    name: str
    label: str
    unit: str
    start: datetime
    end: datetime
    buckets: list[datetime]


def windows(now: datetime) -> dict[str, Window]:
    """The three windows ending at `now`, by name, the shortest first."""
    now = now.astimezone(UTC)
    current = {
        "minute": now.replace(second=0, microsecond=0),
        "hour": now.replace(minute=0, second=0, microsecond=0),
        "day": midnight(now.date()),
    }
    found = {}
    for name, (label, unit, step, count) in WINDOWS.items():
        start = current[unit] - step * (count - 1)
        buckets = [start + step * n for n in range(count)]
        found[name] = Window(name, label, unit, start, now, buckets)
    return found


def usage_by_bucket(org: Org, window: Window) -> list[UsageTotals]:
    """The org's usage in each bucket of `window`, in order."""
    if window.unit == "day":
        report = UsageReport.build(org, window.start, window.end, "day")
        found = {midnight(day): totals for day, totals in report.rows}
    else:
        rows = UsageRecord.objects.filter(
            org=org, created__gte=window.start, created__lt=window.end
        ).annotate(bucket=Trunc("created", window.unit, tzinfo=UTC))
        found = {bucket: totals for (bucket,), totals in summed(rows, ["bucket"], ledger=True)}
    return [found.get(bucket, UsageTotals()) for bucket in window.buckets]


@dataclass(frozen=True)
class Percentiles:
    """p50 and p95 (seconds; None without values) of `count` values."""

    p50: float | None
    p95: float | None
    count: int


def percentile_cont(ordered: list[float], fraction: float) -> float | None:
    """PostgreSQL's `percentile_cont`: linear interpolation between the two nearest ranks of
    the sorted `ordered`; None when empty."""
    if not ordered:
        return None
    position = fraction * (len(ordered) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def latency_percentiles(org: Org, chosen: list[Window]) -> dict[str, dict[str, Percentiles]]:
    """{window name: {latency column: Percentiles}} over the jobs settled in each window: by
    PostgreSQL, or on SQLite (which has no percentile_cont) here."""
    if connection.vendor == "postgresql":
        return percentiles_in_sql(org, chosen)
    return percentiles_in_python(org, chosen)


def percentiles_in_python(org: Org, chosen: list[Window]) -> dict[str, dict[str, Percentiles]]:
    """`latency_percentiles` from the jobs' values, read whole."""
    first, last = min(w.start for w in chosen), max(w.end for w in chosen)
    settled = Job.objects.filter(org=org, finished_at__gte=first, finished_at__lt=last)
    rows = list(settled.values_list("finished_at", *LATENCIES))
    found = {}
    for window in chosen:
        inside = [row for row in rows if window.start <= row[0] < window.end]
        found[window.name] = {}
        for index, column in enumerate(LATENCIES, start=1):
            ordered = sorted(row[index] for row in inside if row[index] is not None)
            p50, p95 = (percentile_cont(ordered, q) for q in QUANTILES)
            found[window.name][column] = Percentiles(p50, p95, len(ordered))
    return found


def percentiles_in_sql(org: Org, chosen: list[Window]) -> dict[str, dict[str, Percentiles]]:
    """`latency_percentiles` in one pass of PostgreSQL over the org's settled jobs: an
    ordered-set aggregate per window and column (both ignore NULLs: a job without a timing
    counts in none)."""
    first, last = min(w.start for w in chosen), max(w.end for w in chosen)
    columns, params = [], []
    quantiles = ", ".join(map(str, QUANTILES))
    for window in chosen:
        for column in LATENCIES:
            inside = "FILTER (WHERE finished_at >= %s AND finished_at < %s)"
            columns.append(
                f"percentile_cont(ARRAY[{quantiles}]) WITHIN GROUP (ORDER BY {column}) {inside}, "
                f"count({column}) {inside}"
            )
            params += [window.start, window.end] * 2
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {', '.join(columns)} FROM {Job._meta.db_table} "
            "WHERE org_id = %s AND finished_at >= %s AND finished_at < %s",
            [*params, org.pk, first, last],
        )
        values = iter(cursor.fetchone())
    found = {}
    for window in chosen:
        found[window.name] = {}
        for column in LATENCIES:
            quantile_values, count = next(values), next(values)
            p50, p95 = quantile_values or (None, None)
            found[window.name][column] = Percentiles(p50, p95, count)
    return found


@dataclass(frozen=True)
class ErrorCount:
    """How many errors of one kind: failed or expired jobs (`source` "job") by their code, or
    the API's error responses (`source` "api") by status and code."""

    source: str
    code: str
    status: int | None
    count: int

    @property
    def label(self) -> str:
        if self.source == "job":
            return f"job {self.code}"
        return f"{self.status} {self.code}" if self.code else str(self.status)


def errors_by_code(org: Org, chosen: list[Window]) -> dict[str, list[ErrorCount]]:
    """{window name: its errors by code, the most frequent first}."""
    first, last = min(w.start for w in chosen), max(w.end for w in chosen)
    per_window = {
        w.name: Count("pk", filter=Q(finished_at__gte=w.start, finished_at__lt=w.end))
        for w in chosen
    }
    # A job stopped by its deadline after it started expired without a code.
    code = Case(
        When(error_code="", then=F("status")), default=F("error_code"), output_field=CharField()
    )
    jobs = (
        Job.objects.filter(
            org=org,
            status__in=[Job.FAILED, Job.EXPIRED],
            finished_at__gte=first,
            finished_at__lt=last,
        )
        .annotate(code=code)
        .values("code")
        .annotate(**per_window)
        .order_by()
    )
    api = (
        ApiErrorCount.objects.filter(org=org, minute__gte=first, minute__lt=last)
        .values("status", "code")
        .annotate(
            **{
                w.name: Sum("count", filter=Q(minute__gte=w.start, minute__lt=w.end))
                for w in chosen
            }
        )
        .order_by()
    )
    found = defaultdict(list)
    for row in jobs:
        for window in chosen:
            if row[window.name]:
                found[window.name].append(ErrorCount("job", row["code"], None, row[window.name]))
    for row in api:
        for window in chosen:
            if row[window.name]:
                error = ErrorCount("api", row["code"], row["status"], row[window.name])
                found[window.name].append(error)
    return {w.name: sorted(found[w.name], key=lambda e: (-e.count, e.label)) for w in chosen}


@dataclass(frozen=True)
class Figures:
    """Everything the dashboard shows of an org, for each window (by name)."""

    windows: dict[str, Window]
    usage: dict[str, list[UsageTotals]]  # per bucket
    latency: dict[str, dict[str, Percentiles]]
    errors: dict[str, list[ErrorCount]]

    @classmethod
    def gather(cls, org: Org, now: datetime) -> Figures:
        found = windows(now)
        chosen = list(found.values())
        usage = {name: usage_by_bucket(org, window) for name, window in found.items()}
        return cls(found, usage, latency_percentiles(org, chosen), errors_by_code(org, chosen))

    def totals(self, name: str) -> UsageTotals:
        """The usage of window `name`."""
        return sum(self.usage[name], UsageTotals())
