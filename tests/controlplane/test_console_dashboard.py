"""The console's dashboard with Django's test client: its figures for the last hour, 24 hours and
30 days are the ledger's (UsageReport over the same bounds, read from the page), its latency
percentiles are numpy's of the same jobs, its errors are the failed jobs' and the API's own
error responses, and nothing of another org ever shows."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from decimal import Decimal

import numpy
import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from controlplane.accounts.models import ApiKey, Membership
from controlplane.billing.models import UsageRecord
from controlplane.billing.pricing import decimal_string
from controlplane.billing.reports import UsageReport
from controlplane.console.dashboard_figures import (
    percentile_cont,
    percentiles_in_python,
    percentiles_in_sql,
    windows,
)
from controlplane.gateway.models import ApiErrorCount
from controlplane.jobs.models import Job
from controlplane.jobs.settlement import record_completion
from inference.protocol.messages import CompletionResult, Usage

PASSWORD = "correct horse battery"
WINDOW_NAMES = ("hour", "day", "month")


def signed_in(org, username: str, role: str = Membership.OWNER) -> Client:
    user = get_user_model().objects.create_user(username=username, password=PASSWORD)
    Membership.objects.create(org=org, user=user, role=role)
    client = Client()
    client.force_login(user)
    return client


def settle(org, ago: timedelta, usage=(1000, 600, 200), timings=None, error_code=None) -> Job:
    """A job settled through the worker's path (`record_completion`), then moved `ago` into the
    past with its usage row (the ledger's trigger moves the row's daily sums along)."""
    job = Job.objects.create(
        org=org,
        model="SmolLM2-135M-Instruct",
        request={"model": "SmolLM2-135M-Instruct", "prompt": "hi"},
        prompt_token_ids=[3, 4, 5],
    )
    result = CompletionResult(
        request_id=job.request_id,
        job_id=job.id,
        node="node-1",
        text="" if error_code else "hello",
        finish_reason=None if error_code else "stop",
        usage=Usage(*usage),
        timings=timings or {},
        error="it broke" if error_code else None,
        error_code=error_code,
    )
    assert record_completion(result)
    at = timezone.now() - ago
    Job.objects.filter(pk=job.pk).update(created=at - timedelta(seconds=1), finished_at=at)
    UsageRecord.objects.filter(request_id=job.request_id).update(created=at)
    job.refresh_from_db()
    return job


def cell(html: str, element_id: str) -> str:
    """The `data-value` of the element `element_id`."""
    match = re.search(rf'id="{element_id}"[^>]*data-value="([^"]*)"', html)
    assert match, f"no #{element_id} on the page"
    return match.group(1)


def bounds(html: str, window: str):
    """The window's `[start, end)`, as the page states it."""
    match = re.search(rf'id="window-{window}" data-start="([^"]+)" data-end="([^"]+)"', html)
    return datetime.fromisoformat(match.group(1)), datetime.fromisoformat(match.group(2))


def figure(html: str, figure_id: str) -> str:
    start = html.index(f'id="{figure_id}"')
    return html[start : html.index("</svg>", start)]


def segment_values(html: str, figure_id: str, segment: str) -> list[str]:
    return re.findall(rf'<rect class="{segment}" data-value="([^"]*)"', figure(html, figure_id))


def test_its_figures_are_the_ledgers_for_each_window(org_a, smollm2):
    console = signed_in(org_a, "alice")
    settle(org_a, timedelta(seconds=20), usage=(1000, 600, 200))
    settle(org_a, timedelta(minutes=30), usage=(700, 0, 50))
    settle(org_a, timedelta(hours=5), usage=(2000, 1500, 300))
    settle(org_a, timedelta(days=3), usage=(400, 100, 40))
    settle(org_a, timedelta(days=45), usage=(9000, 0, 900))  # outside every window
    response = console.get("/console/")
    assert response.status_code == 200
    html = response.content.decode()

    expected_requests = {"hour": 2, "day": 3, "month": 4}
    for window in WINDOW_NAMES:
        start, end = bounds(html, window)
        total = UsageReport.build(org_a, start, end, "day").total
        assert total.requests == expected_requests[window]
        cost = total.cost_object()
        assert cell(html, f"sum-{window}-requests") == str(total.requests)
        assert cell(html, f"sum-{window}-prompt_tokens") == str(total.prompt_tokens)
        assert cell(html, f"sum-{window}-cached_tokens") == str(total.cached_tokens)
        assert cell(html, f"sum-{window}-completion_tokens") == str(total.completion_tokens)
        assert cell(html, f"sum-{window}-cache_hit_ratio") == str(total.cache_hit_ratio)
        assert cell(html, f"sum-{window}-spend") == cost["total"]
        assert cell(html, f"sum-{window}-savings") == cost["cache_savings"]

    # The charts show the default window, the last 24 hours: their bars add up to its totals.
    start, end = bounds(html, "day")
    total = UsageReport.build(org_a, start, end, "day").total
    assert sum(Decimal(v) for v in segment_values(html, "fig-day-spend", "spend")) == (
        total.total_cost
    )
    assert sum(map(int, segment_values(html, "fig-day-requests", "requests"))) == 3
    assert len(segment_values(html, "fig-day-requests", "requests")) == 24
    tokens = {part: segment_values(html, "fig-day-tokens", part) for part in ("cached", "output")}
    assert sum(map(int, tokens["cached"])) == total.cached_tokens
    assert sum(map(int, tokens["output"])) == total.completion_tokens

    # The 30 days by day: the day three days ago holds its one request.
    month = console.get("/console/?window=month").content.decode()
    days = segment_values(month, "fig-month-requests", "requests")
    assert len(days) == 30 and sum(map(int, days)) == 4
    start, end = bounds(month, "month")
    month_total = UsageReport.build(org_a, start, end, "day").total
    assert re.search(
        rf'id="fig-month-spend" data-total="{decimal_string(month_total.total_cost)}"', month
    )
    minutes = console.get("/console/?window=hour").content.decode()
    assert len(segment_values(minutes, "fig-hour-spend", "spend")) == 60


def test_its_latency_percentiles_are_numpys_of_the_settled_jobs(org_a, smollm2):
    rng = numpy.random.default_rng(7)
    settled = []
    for minutes in [1, 2, 5, 20, 50, 90, 200, 600, 1200, 3000, 9000, 30000]:
        timings = {"ttft_s": float(rng.uniform(0.01, 2)), "tpot_s": float(rng.uniform(0.001, 0.1))}
        settled.append(settle(org_a, timedelta(minutes=minutes), timings=timings))
    # A node that sent no timings: only its queue wait (the control plane's) counts.
    settled.append(settle(org_a, timedelta(minutes=3)))
    chosen = list(windows(timezone.now()).values())
    in_sql, in_python = percentiles_in_sql(org_a, chosen), percentiles_in_python(org_a, chosen)
    html = signed_in(org_a, "alice").get("/console/").content.decode()
    for window in chosen:
        inside = [j for j in settled if window.start <= j.finished_at < window.end]
        for column in ("ttft_s", "tpot_s", "queue_wait_s"):
            values = [getattr(j, column) for j in inside if getattr(j, column) is not None]
            assert in_sql[window.name][column].count == len(values)
            for quantile in ("p50", "p95"):
                expected = numpy.percentile(values, int(quantile[1:]))
                assert getattr(in_sql[window.name][column], quantile) == pytest.approx(expected)
                assert getattr(in_python[window.name][column], quantile) == pytest.approx(expected)
                shown = cell(html, f"sum-{window.name}-{column.removesuffix('_s')}_{quantile}")
                assert float(shown) == pytest.approx(expected)


def test_percentile_cont_interpolates_as_numpy_does():
    rng = numpy.random.default_rng(3)
    for size in (1, 2, 3, 10, 101):
        values = sorted(rng.exponential(size=size).tolist())
        for fraction in (0.0, 0.5, 0.95, 1.0):
            expected = numpy.percentile(values, fraction * 100)
            assert percentile_cont(values, fraction) == pytest.approx(expected)
    assert percentile_cont([], 0.5) is None


def test_it_counts_failed_jobs_and_the_apis_error_responses_by_code(org_a, smollm2, api):
    _, secret = ApiKey.objects.create_key(org_a, "ci")
    settle(org_a, timedelta(minutes=2), error_code="out_of_memory")
    settle(org_a, timedelta(minutes=3), error_code="out_of_memory")
    settle(org_a, timedelta(hours=3), error_code="node_error")
    Job.objects.create(
        org=org_a,
        model="SmolLM2-135M-Instruct",
        request={},
        prompt_token_ids=[1],
        deadline_at=timezone.now() - timedelta(seconds=1),
    ).expire()
    # Error responses of DRF views (the completions view's: the test below).
    assert api.get("/v1/jobs/job_nope", key=secret).status_code == 404
    assert api.get("/v1/usage?group_by=week", key=secret).status_code == 400
    assert api.get("/v1/usage?group_by=week", key=secret).status_code == 400
    # A refused key belongs to no org: not counted.
    assert api.get("/v1/jobs/job_nope", key="hk_bad_key").status_code == 401
    counted = {(r.status, r.code): r.count for r in ApiErrorCount.objects.filter(org=org_a)}
    assert counted == {(404, "job_not_found"): 1, (400, "invalid_value"): 2}

    html = signed_in(org_a, "alice").get("/console/?window=hour").content.decode()
    errors = dict(
        ((source, code), int(count))
        for source, code, count in re.findall(
            r'<g class="error" data-source="(\w+)" data-code="([^"]*)" data-status="[^"]*" '
            r'data-value="(\d+)"',
            figure(html, "fig-hour-errors"),
        )
    )
    expected_api = {("api", code): n for (_, code), n in counted.items()}
    assert errors == {("job", "out_of_memory"): 2, ("job", "expired"): 1, **expected_api}
    assert cell(html, "sum-hour-job_errors") == "3"
    assert cell(html, "sum-day-job_errors") == "4"
    assert cell(html, "sum-hour-api_errors") == "3"


@pytest.mark.django_db(transaction=True)
def test_it_counts_the_completion_endpoints_refusals(org_a, smollm2, post):
    """Admission runs in a thread of its own, with its own connection: committed fixtures."""
    _, secret = ApiKey.objects.create_key(org_a, "ci")
    assert post("/v1/chat/completions", b"{nope", key=secret, raw=True).status_code == 400
    unknown = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    assert post("/v1/chat/completions", unknown, key=secret).status_code == 404
    assert post("/v1/chat/completions", unknown, key="hk_bad_key").status_code == 401
    counted = {(r.status, r.code): r.count for r in ApiErrorCount.objects.filter(org=org_a)}
    assert counted == {(400, "invalid_json"): 1, (404, "model_not_found"): 1}
    html = signed_in(org_a, "alice").get("/console/").content.decode()
    assert cell(html, "sum-hour-api_errors") == "2"


def test_another_orgs_usage_and_errors_never_show(org_a, org_b, smollm2):
    settle(org_b, timedelta(minutes=1), usage=(1000, 600, 200), timings={"ttft_s": 0.5})
    settle(org_b, timedelta(minutes=2), error_code="out_of_memory")
    ApiErrorCount.objects.add(org_b.id, 429, "rate_limit_exceeded")
    html = signed_in(org_a, "alice").get("/console/").content.decode()
    for window in WINDOW_NAMES:
        assert cell(html, f"sum-{window}-requests") == "0"
        assert cell(html, f"sum-{window}-spend") == "0"
        assert cell(html, f"sum-{window}-job_errors") == "0"
        assert cell(html, f"sum-{window}-api_errors") == "0"
        assert cell(html, f"sum-{window}-ttft_p50") == ""
    assert 'id="no-errors"' in html
    # Org B's own dashboard has them.
    theirs = signed_in(org_b, "bob").get("/console/").content.decode()
    assert cell(theirs, "sum-hour-requests") == "1"
    assert cell(theirs, "sum-hour-api_errors") == "1"


@pytest.mark.parametrize("role", [Membership.BILLING, Membership.DEVELOPER])
def test_every_role_sees_the_dashboard(org_a, role):
    assert signed_in(org_a, f"user-{role}", role).get("/console/").status_code == 200


def test_an_unknown_window_is_a_404_that_says_which_exist(org_a):
    response = signed_in(org_a, "alice").get("/console/?window=week")
    assert response.status_code == 404


def test_the_error_counter_adds_into_one_row_per_minute_and_code(org_a):
    at = timezone.now().replace(second=5)
    for _ in range(3):
        ApiErrorCount.objects.add(org_a.id, 429, "rate_limit_exceeded", at=at)
    ApiErrorCount.objects.add(org_a.id, 429, "rate_limit_exceeded", at=at + timedelta(minutes=1))
    rows = ApiErrorCount.objects.filter(org=org_a).order_by("minute")
    assert [(r.minute, r.count) for r in rows] == [
        (at.replace(second=0, microsecond=0), 3),
        (at.replace(second=0, microsecond=0) + timedelta(minutes=1), 1),
    ]
