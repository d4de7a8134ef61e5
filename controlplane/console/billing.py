"""The console's billing pages: a month's spend per day, by model and by key, the cache's savings,
the invoices, CSV downloads, and a printable page per invoice.

The numbers are the API's (`UsageReport`, `Invoice`), for the signed-in user's org; another
org's invoice is a 404.
"""

from __future__ import annotations

from datetime import date, datetime, timedelta
from decimal import Decimal

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, render
from django.utils import timezone
from django.views.decorators.http import require_GET

from controlplane.billing.invoices import FINALIZE_AFTER, Invoice
from controlplane.billing.limits_api import RATE_FIELDS, budget_object
from controlplane.billing.pricing import decimal_string
from controlplane.billing.reports import GROUPINGS, UsageReport, month_bounds
from controlplane.console.roles import console_view

CHART_HEIGHT = 160  # px of the tallest day's bar
CHART_BAR = 18  # px per day, gap included


def chosen_month(request: HttpRequest) -> date:
    """`?month=YYYY-MM`, the current UTC month without it; a 404 for anything else."""
    raw = request.GET.get("month")
    if raw is None:
        return timezone.now().date().replace(day=1)
    try:
        return datetime.strptime(raw, "%Y-%m").date()
    except ValueError:
        raise Http404("'month' must read YYYY-MM.") from None


def spend_chart(report: UsageReport, start: datetime, end: datetime) -> list[dict]:
    """One bar per day of the month (empty days too): its day, exact total and pixel height."""
    by_day = dict(report.rows)
    days = [(start + timedelta(days=n)).date() for n in range((end - start).days)]
    costs = {day: by_day[day].total_cost if day in by_day else Decimal(0) for day in days}
    tallest = max(costs.values(), default=Decimal(0))
    bars = []
    for index, day in enumerate(days):
        height = int(costs[day] * CHART_HEIGHT / tallest) if tallest else 0
        bars.append(
            {
                "day": day,
                "cost": decimal_string(costs[day]),
                "x": index * CHART_BAR,
                "y": CHART_HEIGHT - height,
                "height": height,
            }
        )
    return bars


def used_percent(budget: dict) -> Decimal | None:
    """Spent and reserved over the org's monthly budget, in percent (None without a budget)."""
    if budget["monthly_budget_usd"] is None:
        return None
    limit = Decimal(budget["monthly_budget_usd"])
    used = Decimal(budget["spent_usd"]) + Decimal(budget["reserved_usd"])
    return round(used * 100 / limit, 1) if limit else Decimal(100)


def report_rows(report: UsageReport) -> list[dict]:
    """A report's rows as the tables show them, the most expensive first."""
    rows = [
        {**report.group_fields(value), "totals": totals, "cost": totals.cost_object()}
        for value, totals in report.rows
    ]
    return sorted(rows, key=lambda row: row["totals"].total_cost, reverse=True)


@require_GET
@console_view("billing")
def billing(request: HttpRequest) -> HttpResponse:
    month = chosen_month(request)
    start, end = month_bounds(month)
    by_day = UsageReport.build(request.org, start, end, "day")
    by_model = UsageReport.build(request.org, start, end, "model")
    by_key = UsageReport.build(request.org, start, end, "key")
    invoices = [invoice.as_object() for invoice in Invoice.objects.for_org(request.org)]
    budget = budget_object(request.org)
    context = {
        "budget": budget,
        "budget_used_percent": used_percent(budget),
        "limited_keys": [
            key
            for key in budget["keys"]
            if any(key[f] is not None for f in ("monthly_budget_usd", *RATE_FIELDS))
        ],
        "month": month,
        "month_param": f"{month:%Y-%m}",
        "previous_month": f"{month - timedelta(days=1):%Y-%m}",
        "next_month": f"{end:%Y-%m}" if end <= timezone.now() else None,
        "total": by_day.total,
        "total_cost": by_day.total.cost_object(),
        "cache_hit_percent": round(by_day.total.cache_hit_ratio * 100, 1),
        "bars": spend_chart(by_day, start, end),
        "chart_width": (end - start).days * CHART_BAR,
        "chart_height": CHART_HEIGHT,
        "chart_bar_width": CHART_BAR - 4,
        "by_model": report_rows(by_model),
        "by_key": report_rows(by_key),
        "invoices": invoices,
        "groupings": GROUPINGS,
    }
    return render(request, "console/billing.html", context)


@require_GET
@console_view("billing")
def usage_csv(request: HttpRequest) -> HttpResponse:
    """The month's usage as `/v1/usage?format=csv` gives it, grouped by `?group_by=`."""
    group_by = request.GET.get("group_by", "day")
    if group_by not in GROUPINGS:
        raise Http404(f"'group_by' must be one of {list(GROUPINGS)}.")
    month = chosen_month(request)
    report = UsageReport.build(request.org, *month_bounds(month), group_by)
    response = HttpResponse(report.as_csv(), content_type="text/csv; charset=utf-8")
    filename = f"usage-{group_by}-{month:%Y-%m}.csv"
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


@require_GET
@console_view("billing")
def invoice(request: HttpRequest, invoice_id: str) -> HttpResponse:
    """An invoice as a page to print."""
    found = get_object_or_404(Invoice, id=invoice_id, org=request.org)
    found.finalize_if_due(timezone.now())
    context = {
        "invoice": found.as_object(),
        "final_from": month_bounds(found.period_start)[1] + FINALIZE_AFTER,
    }
    return render(request, "console/invoice.html", context)
