"""Console benchmark: the server time of the dashboard and of the jobs page over a month of one
org's traffic, against the usage report of the same 30 days measured in the same run.

Fills a PostgreSQL database of its own (`hearth_bench_console`, created and migrated here) with
one org holding, spread evenly over the last 30 days up to now:
- `--usage-rows` ledger rows (1,000,000), written with INSERT … SELECT generate_series, 2,000 a
  statement; the ledger's trigger keeps the daily sums (UsageDay) as the worker's writes would;
- `--jobs` settled jobs (100,000), rows the size of real ones (a 200-token prompt, a result with
  its text, tokens, usage, cost and timings): 97 % completed with random TTFT, time per output
  token and queue wait, 2 % failed under two codes, 1 % expired;
- the API's error counts: a 429 every minute of the 30 days and a 400 every tenth (gateway
  ApiErrorCount rows, one per minute and code, as a steady rate limit leaves them).

Then, in process through Django's test client signed in as the org's owner, times each GET
(middleware, session and template included) of `/console/` (the dashboard, its default window)
and `/console/jobs`, and `UsageReport.build` over the dashboard's 30 days (what `/v1/usage`
runs): p50 and p99 over `--loads` (50) each, after 5 unmeasured ones. The dashboard's parts
(usage per window, latency percentiles, errors) are timed alone too, to show where its time goes.

Targets (issue 26): dashboard p99 ≤ 300 ms, jobs page p99 ≤ 200 ms. Prints a table and, as the
last line, one JSON object, also written to bench/results/console.json.

    .venv/bin/python bench/console.py            # 1,000,000 usage rows, 100,000 jobs
    .venv/bin/python bench/console.py --usage-rows 100000 --jobs 10000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.gateway import log, percentile, setup_django  # noqa: E402

DATABASE = "hearth_bench_console"
DAYS = 30
CHUNK = 2000  # ledger rows per INSERT: see bench/billing.py (the trigger's per-row update)
JOB_CHUNK = 10_000
WARM_UP = 5


def prepare_database(admin_url: str) -> str:
    import psycopg

    with psycopg.connect(f"{admin_url}/postgres", autocommit=True) as connection:
        connection.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        connection.execute(f"CREATE DATABASE {DATABASE}")
    return f"{admin_url}/{DATABASE}"


def seed():
    """The org, its key, a priced model and the owner the console signs in as."""
    from django.contrib.auth import get_user_model

    from controlplane.accounts.management.commands.demo import DEMO_PRICES
    from controlplane.accounts.models import ApiKey, Membership, Org
    from controlplane.catalog.models import Price, ServedModel

    org = Org.objects.create(slug="bench", name="Bench")
    model = ServedModel.objects.create(id="tiny-bench", source="tiny-bench", context_length=4096)
    price = Price.objects.create(model=model, **DEMO_PRICES, async_discount_percent=50)
    key, _ = ApiKey.objects.create_key(org, "bench")
    user = get_user_model().objects.create_user("bench-owner", password="bench-password")
    Membership.objects.create(org=org, user=user, role=Membership.OWNER)
    return org, key, price, user


def write_ledger(org, key, price, rows: int, start: datetime, seconds: int) -> float:
    """`rows` usage rows spread evenly over `seconds` from `start`; seconds taken."""
    from django.db import connection

    from controlplane.billing.models import UsageRecord

    began = time.perf_counter()
    with connection.cursor() as cursor:
        for first in range(0, rows, CHUNK):
            cursor.execute(
                f"""
                INSERT INTO {UsageRecord._meta.db_table}
                  (request_id, org_id, api_key_id, model, mode, prompt_tokens, cached_tokens,
                   completion_tokens, price_id, discount_percent, input_cost, cached_input_cost,
                   output_cost, total_cost, cache_savings, created)
                SELECT 'req_bench_' || n, %(org)s, %(key)s, %(model)s, 'sync', 1000, 600, 200,
                       %(price)s, 0, 0.00024, 0.00006, 0.0006, 0.0009, 0.0003,
                       %(start)s::timestamptz
                         + (n::bigint * %(seconds)s / %(rows)s) * interval '1 second'
                FROM generate_series(%(first)s, %(last)s) AS n
                """,
                {
                    "org": org.pk,
                    "key": key.pk,
                    "model": price.model_id,
                    "price": price.pk,
                    "start": start,
                    "seconds": seconds,
                    "rows": rows,
                    "first": first,
                    "last": min(first + CHUNK, rows) - 1,
                },
            )
    return time.perf_counter() - began


def write_jobs(org, key, jobs: int, start: datetime, seconds: int) -> float:
    """`jobs` settled jobs created evenly over `seconds` from `start`; seconds taken."""
    from django.db import connection

    from controlplane.jobs.models import Job

    prompt_ids = json.dumps(list(range(1000, 1200)))
    request = json.dumps(
        {
            "model": "tiny-bench",
            "messages": [
                {"role": "system", "content": "You review code. Answer in one sentence."},
                {"role": "user", "content": "Is this change safe to merge? " * 4},
            ],
            "max_tokens": 64,
        }
    )
    result = json.dumps(
        {
            "text": "It looks safe: the change only renames a local variable. " * 3,
            "token_ids": list(range(2000, 2064)),
            "finish_reason": "stop",
            "usage": {"prompt_tokens": 200, "cached_tokens": 120, "completion_tokens": 64},
            "cost": {"input": "0.000048", "cached_input": "0.000012", "output": "0.000192"},
            "timings": {"ttft_s": 0.05, "tpot_s": 0.02, "e2e_s": 1.3},
            "logprobs": None,
            "choices": None,
        }
    )
    began = time.perf_counter()
    with connection.cursor() as cursor:
        for first in range(0, jobs, JOB_CHUNK):
            cursor.execute(
                f"""
                INSERT INTO {Job._meta.db_table}
                  (id, request_id, org_id, api_key_id, model, mode, endpoint, session_affinity,
                   status, request, prompt_token_ids, sampling, result, error, node,
                   attempts, created, started_at, finished_at, queue, route, prefill_queue,
                   dispatches, dispatched_at, reserved_cost, budget_scopes, custom_id,
                   ttft_s, tpot_s, e2e_s, queue_wait_s, error_code)
                SELECT 'job_bench_' || n, 'req_job_bench_' || n, %(org)s, %(key)s, 'tiny-bench',
                       'sync', 'chat.completions', '', kind.status, %(request)s::jsonb,
                       %(prompt)s::jsonb, '{{"temperature": 0.7}}'::jsonb,
                       CASE WHEN kind.completed THEN %(result)s::jsonb END,
                       CASE WHEN kind.completed THEN '' ELSE 'it broke' END,
                       'node-' || (n %% 8), 1, draw.created,
                       draw.created + draw.wait_s * interval '1 second',
                       draw.created + (draw.wait_s + draw.e2e_s) * interval '1 second',
                       'tiny-bench', 'prefix', '', 1, draw.created, 0, '[]'::jsonb, '',
                       CASE WHEN kind.completed THEN draw.ttft_s END,
                       CASE WHEN kind.completed THEN draw.tpot_s END,
                       CASE WHEN kind.completed THEN draw.e2e_s END,
                       draw.wait_s, kind.code
                FROM generate_series(%(first)s, %(last)s) AS n,
                     -- Both refer to n: drawn afresh for each row.
                     LATERAL (SELECT %(start)s::timestamptz
                                       + (n::bigint * %(seconds)s / %(jobs)s) * interval '1 second'
                                       AS created,
                                     random() * 2 AS wait_s, 0.02 + random() * 0.5 AS ttft_s,
                                     0.005 + random() * 0.05 AS tpot_s,
                                     0.5 + random() * 3 AS e2e_s) AS draw,
                     LATERAL (SELECT n %% 100 < 97 AS completed,
                                     CASE WHEN n %% 100 < 97 THEN 'completed'
                                          WHEN n %% 100 < 99 THEN 'failed'
                                          ELSE 'expired' END AS status,
                                     CASE WHEN n %% 100 < 97 THEN ''
                                          WHEN n %% 100 = 97 THEN 'node_error'
                                          WHEN n %% 100 = 98 THEN 'out_of_memory'
                                          ELSE 'expired' END AS code) AS kind
                """,
                {
                    "org": org.pk,
                    "key": key.pk,
                    "request": request,
                    "prompt": prompt_ids,
                    "result": result,
                    "start": start,
                    "seconds": seconds,
                    "jobs": jobs,
                    "first": first,
                    "last": min(first + JOB_CHUNK, jobs) - 1,
                },
            )
    return time.perf_counter() - began


def write_api_errors(org, start: datetime, minutes: int) -> int:
    """A 429 every minute and a 400 every tenth, as ApiErrorCount rows; how many rows."""
    from django.db import connection

    from controlplane.gateway.models import ApiErrorCount

    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            INSERT INTO {ApiErrorCount._meta.db_table} (org_id, minute, status, code, count)
            SELECT %(org)s, date_trunc('minute', %(start)s::timestamptz) + n * interval '1 minute',
                   error.status, error.code, 1 + n %% 7
            FROM generate_series(0, %(minutes)s - 1) AS n,
                 (VALUES (429, 'rate_limit_exceeded', 1), (400, 'invalid_value', 10))
                   AS error (status, code, every)
            WHERE n %% error.every = 0
            """,
            {"org": org.pk, "start": start, "minutes": minutes},
        )
        return cursor.rowcount


def timed(runs: int, work) -> list[float]:
    """Seconds of each of `runs` calls of `work`, after WARM_UP unmeasured ones."""
    for _ in range(WARM_UP):
        work()
    samples = []
    for _ in range(runs):
        began = time.perf_counter()
        work()
        samples.append(time.perf_counter() - began)
    return samples


def get_ok(client, path: str):
    def load():
        response = client.get(path)
        assert response.status_code == 200, (path, response.status_code)

    return load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--usage-rows", type=int, default=1_000_000)
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--loads", type=int, default=50)
    parser.add_argument("--postgres", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()

    setup_django(prepare_database(args.postgres), args.redis, f"hearth-bench-{os.getpid()}")
    from django.conf import settings
    from django.db import connection
    from django.test import Client
    from django.utils import timezone

    from controlplane.billing.reports import UsageReport
    from controlplane.console import dashboard_figures as figures

    # The test client's host. Not `setup_test_environment`: its instrumented template rendering
    # copies every context for the test client, which would count against the pages.
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
    org, key, price, user = seed()
    now = timezone.now()
    start = now - timedelta(days=DAYS)
    seconds = DAYS * 24 * 3600
    log(f"writing {args.usage_rows} ledger rows")
    ledger_s = write_ledger(org, key, price, args.usage_rows, start, seconds)
    log(f"writing {args.jobs} jobs")
    jobs_s = write_jobs(org, key, args.jobs, start, seconds)
    error_rows = write_api_errors(org, start, DAYS * 24 * 60)
    with connection.cursor() as cursor:
        # As autovacuum leaves rows that no longer change: visible to index-only scans.
        cursor.execute("VACUUM ANALYZE")

    client = Client()
    client.force_login(user)
    log(f"timing {args.loads} loads of each")
    dashboard = timed(args.loads, get_ok(client, "/console/"))
    jobs_page = timed(args.loads, get_ok(client, "/console/jobs"))
    month = figures.windows(timezone.now())["month"]
    report = timed(args.loads, lambda: UsageReport.build(org, month.start, timezone.now(), "day"))
    assert UsageReport.build(org, start, timezone.now(), "day").total.requests == args.usage_rows

    every = list(figures.windows(timezone.now()).values())
    parts = {f"usage_{w.name}": (lambda w=w: figures.usage_by_bucket(org, w)) for w in every}
    parts["latency"] = lambda: figures.latency_percentiles(org, every)
    parts["errors"] = lambda: figures.errors_by_code(org, every)
    part_ms = {name: percentile(timed(10, work), 50) * 1000 for name, work in parts.items()}

    ms = 1000
    result = {
        "benchmark": "console",
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "usage_rows": args.usage_rows,
        "jobs": args.jobs,
        "api_error_rows": error_rows,
        "loads": args.loads,
        "dashboard_p50_ms": round(percentile(dashboard, 50) * ms, 1),
        "dashboard_p99_ms": round(percentile(dashboard, 99) * ms, 1),
        "jobs_p50_ms": round(percentile(jobs_page, 50) * ms, 1),
        "jobs_p99_ms": round(percentile(jobs_page, 99) * ms, 1),
        "usage_report_p50_ms": round(percentile(report, 50) * ms, 1),
        "usage_report_p99_ms": round(percentile(report, 99) * ms, 1),
        **{f"dashboard_{name}_p50_ms": round(value, 1) for name, value in part_ms.items()},
        "ledger_written_s": round(ledger_s, 1),
        "jobs_written_s": round(jobs_s, 1),
    }
    table = [
        ("dashboard p50 (ms)", result["dashboard_p50_ms"], ""),
        ("dashboard p99 (ms)", result["dashboard_p99_ms"], "<= 300"),
        *((f"  {name} p50 (ms)", round(value, 1), "") for name, value in part_ms.items()),
        ("jobs page p50 (ms)", result["jobs_p50_ms"], ""),
        ("jobs page p99 (ms)", result["jobs_p99_ms"], "<= 200"),
        ("baseline: usage report, 30 days p50 (ms)", result["usage_report_p50_ms"], ""),
        ("baseline: usage report, 30 days p99 (ms)", result["usage_report_p99_ms"], ""),
    ]
    print(f"{args.usage_rows} usage rows, {args.jobs} jobs, {error_rows} API error rows")
    print(f"{'metric':44} {'value':>10}  target")
    for name, value, target in table:
        print(f"{name:44} {value:>10}  {target}")
    out = REPO_ROOT / "bench" / "results" / "console.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
