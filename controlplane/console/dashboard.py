"""The console's dashboard, the page after sign-in: the org's requests, tokens, cache hits, spend,
savings from the prefix cache, errors and latency percentiles over the last hour, 24 hours and
30 days. A table sums up all three windows; the charts show one (`?window=hour|day|month`, the
last 24 hours without it): spend, requests and tokens per bucket, and errors by code.

The figures are the database's (console/dashboard_figures.py), for the signed-in user's org.
Charts are SVG drawn here, nothing is downloaded; the page's only script fetches the page again
when jobs settle (their events over /ws/events) and every minute, and swaps the figures in. Each
chart has an element id (`fig-<window>-<what>`) and each number its exact value in `data-value`,
so a test reads what a person sees.
"""

from __future__ import annotations

from decimal import Decimal

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import path
from django.utils import timezone
from django.views.decorators.http import require_GET

from controlplane.billing.pricing import decimal_string
from controlplane.billing.reports import UsageTotals
from controlplane.console.dashboard_figures import WINDOWS, ErrorCount, Figures, Window
from controlplane.console.roles import console_view

DEFAULT_WINDOW = "day"
CHART_WIDTH, CHART_HEIGHT = 1000, 140  # of the plot, in the SVG's units (it scales to the page)
BAR_GAP = 0.2  # of each bucket's width
# Which buckets are labelled on the time axis: round times, evenly spaced.
LABELLED = {
    "minute": lambda start: start.minute % 10 == 0,
    "hour": lambda start: start.hour % 3 == 0,
    "day": lambda start: start.toordinal() % 5 == 0,
}
BUCKET_FORMAT = {"minute": "%H:%M", "hour": "%H:00", "day": "%b %d"}
ERROR_ROW = 22  # px per code in the errors chart
ERROR_LABEL = 220  # px left of the bars, for the codes
ERROR_BAR = 420  # px of the most frequent code's bar
LATENCY_LABELS = {"ttft_s": "TTFT", "tpot_s": "Time per output token", "queue_wait_s": "Queue wait"}


def shown(value) -> str:
    """A number as the page writes it: an amount in full (no exponent), a count as it is."""
    return decimal_string(value) if isinstance(value, Decimal) else str(value)


def duration(seconds: float | None) -> str:
    """Seconds for a person: milliseconds below 10 s; a dash without a value."""
    if seconds is None:
        return "—"
    if seconds >= 10:
        return f"{seconds:.1f} s"
    return f"{seconds * 1000:.1f} ms" if seconds < 0.01 else f"{seconds * 1000:.0f} ms"


def bar_chart(
    fig_id: str, title: str, unit: str, window: Window, parts: dict[str, str], values: list
) -> dict:
    """A time series of stacked bars, one per bucket of `window`. `parts`: each segment's class
    and legend, stacked bottom up; `values[i]`: bucket i's value of each, in that order; `unit`
    names what they count."""
    slot = CHART_WIDTH / len(window.buckets)
    totals = [sum(bucket) for bucket in values]
    tallest = max(totals)
    bars = []
    for index, (start, bucket) in enumerate(zip(window.buckets, values, strict=True)):
        top, segments = float(CHART_HEIGHT), []
        for name, value in zip(parts, bucket, strict=True):
            height = float(value) * CHART_HEIGHT / float(tallest) if tallest else 0.0
            top -= height
            segments.append(
                {"cls": name, "value": shown(value), "y": round(top, 2), "height": round(height, 2)}
            )
        label = start.strftime(BUCKET_FORMAT[window.unit])
        if len(parts) == 1:
            what = f"{shown(bucket[0])} {unit}"
        else:
            what = ", ".join(
                f"{shown(v)} {legend}" for legend, v in zip(parts.values(), bucket, strict=True)
            )
        bars.append(
            {
                "start": start.isoformat(),
                "x": round(index * slot, 2),
                "segments": segments,
                "title": f"{label} UTC: {what}",
            }
        )
    ticks = [
        {"x": round(i * slot, 2), "text": start.strftime(BUCKET_FORMAT[window.unit])}
        for i, start in enumerate(window.buckets)
        if LABELLED[window.unit](start)
    ]
    return {
        "id": fig_id,
        "title": title,
        "legend": parts if len(parts) > 1 else {},
        "bars": bars,
        "ticks": ticks,
        "bar_width": round(slot * (1 - BAR_GAP), 2),
        "tallest": f"{shown(tallest)} {unit}",
        "total": shown(sum(totals)),
    }


def usage_charts(window: Window, buckets: list[UsageTotals]) -> list[dict]:
    """Spend, requests and tokens per bucket of `window`."""
    name = f"fig-{window.name}"
    return [
        bar_chart(
            f"{name}-spend",
            "Spend",
            "USD",
            window,
            {"spend": "spend"},
            [[t.total_cost] for t in buckets],
        ),
        bar_chart(
            f"{name}-requests",
            "Requests",
            "requests",
            window,
            {"requests": "requests"},
            [[t.requests] for t in buckets],
        ),
        bar_chart(
            f"{name}-tokens",
            "Tokens",
            "tokens",
            window,
            {"uncached": "input", "cached": "cached input", "output": "output"},
            [
                [t.prompt_tokens - t.cached_tokens, t.cached_tokens, t.completion_tokens]
                for t in buckets
            ],
        ),
    ]


def errors_chart(window: Window, errors: list[ErrorCount]) -> dict:
    """Horizontal bars, one per error code, the most frequent first."""
    most = max((e.count for e in errors), default=0)
    rows = [
        {
            "error": error,
            "y": index * ERROR_ROW,
            "width": round(error.count * ERROR_BAR / most, 2),
        }
        for index, error in enumerate(errors)
    ]
    return {
        "id": f"fig-{window.name}-errors",
        "rows": rows,
        "height": max(len(rows), 1) * ERROR_ROW,
        "bar_x": ERROR_LABEL,
        "width": ERROR_LABEL + ERROR_BAR + 60,
        "total": sum(e.count for e in errors),
    }


def summary_rows(figures: Figures) -> list[dict]:
    """The table of all three windows: one row per figure, a cell per window, each with what it
    shows and its exact value."""
    totals = {name: figures.totals(name) for name in figures.windows}

    def row(key: str, label: str, cell) -> dict:
        cells = []
        for name in figures.windows:
            text, value = cell(name)
            cells.append({"id": f"sum-{name}-{key}", "text": text, "value": value})
        return {"label": label, "cells": cells}

    def usage(field: str, money: bool = False):
        def cell(name: str) -> tuple[str, str]:
            value = shown(getattr(totals[name], field))
            return (f"${value}" if money else value), value

        return cell

    def hits(name: str) -> tuple[str, str]:
        ratio = totals[name].cache_hit_ratio
        return f"{ratio * 100:.1f} %", str(ratio)

    def errors_of(source: str):
        def cell(name: str) -> tuple[str, str]:
            count = str(sum(e.count for e in figures.errors[name] if e.source == source))
            return count, count

        return cell

    def percentile(column: str, quantile: str):
        def cell(name: str) -> tuple[str, str]:
            seconds = getattr(figures.latency[name][column], quantile)
            return duration(seconds), "" if seconds is None else repr(seconds)

        return cell

    rows = [
        row("requests", "Requests", usage("requests")),
        row("prompt_tokens", "Input tokens", usage("prompt_tokens")),
        row("cached_tokens", "Cached input tokens", usage("cached_tokens")),
        row("completion_tokens", "Output tokens", usage("completion_tokens")),
        row("cache_hit_ratio", "Cache hit ratio", hits),
        row("spend", "Spend", usage("total_cost", money=True)),
        row("savings", "Saved by the prefix cache", usage("cache_savings", money=True)),
        row("job_errors", "Failed and expired jobs", errors_of("job")),
        row("api_errors", "API errors", errors_of("api")),
    ]
    for column, label in LATENCY_LABELS.items():
        for quantile in ("p50", "p95"):
            key = f"{column.removesuffix('_s')}_{quantile}"
            rows.append(row(key, f"{label} {quantile}", percentile(column, quantile)))
    return rows


def chosen_window(request: HttpRequest) -> str:
    """`?window=`: hour, day or month (the last 24 hours without it); a 404 for anything else."""
    name = request.GET.get("window", DEFAULT_WINDOW)
    if name not in WINDOWS:
        raise Http404(f"'window' must be one of {', '.join(WINDOWS)}.")
    return name


@require_GET
@console_view("dashboard")
def overview(request: HttpRequest) -> HttpResponse:
    name = chosen_window(request)
    figures = Figures.gather(request.org, timezone.now())
    window = figures.windows[name]
    context = {
        "windows": list(figures.windows.values()),
        "window": window,
        "summary": summary_rows(figures),
        "charts": usage_charts(window, figures.usage[name]),
        "errors": errors_chart(window, figures.errors[name]),
        "chart_width": CHART_WIDTH,
        "chart_height": CHART_HEIGHT,
    }
    return render(request, "console/dashboard.html", context)


urlpatterns = [path("", overview, name="overview")]
