"""Billing benchmark: what budgets and rate limits add to a request, and a month's usage report
over a million ledger rows.

1. Admission and settlement, on PostgreSQL (database `hearth_bench_billing`, created here) and
   Redis, as the gateway and the worker run them, per request:
   - admission: the key's rate limits taken (one Lua script in Redis) and the request's maximum
     cost reserved in the org's and the key's monthly budgets (a conditional UPDATE each);
   - settlement: the usage row written and both budgets settled (the real cost in, the
     reservation out; one UPDATE).
   `admission_p50_ms`/`admission_p99_ms` are of their sum, without the commits: in production
   these statements ride in the transactions that write and settle the job, which commit
   anyway. The same with a commit of their own each is reported beside it (`commits_p50_ms`).
   The baseline, measured in the same run, is a whole admission (`admit`: authentication,
   tokenization, the job and its event, the enqueue) of the same request without any limit.
2. The month report: 1,000,000 usage rows for one org spread over a month (written with
   INSERT … SELECT generate_series, 2,000 rows a statement; the ledger's trigger keeps the
   daily sums), then
   `GET /v1/usage?group_by=day` for that month (`UsageReport.build`), best of 5. The baseline is
   the same grouping straight from the ledger in SQL (what the report would cost without the
   daily sums).

Targets (issue 6): admission + settlement p50 ≤ 5 ms; the month report ≤ 500 ms. The last line
of stdout is one JSON object, also written to bench/results/billing.json.

    .venv/bin/python bench/billing.py                 # 2,000 requests, 1,000,000 rows
    .venv/bin/python bench/billing.py --requests 200 --rows 20000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.gateway import log, percentile, setup_django  # noqa: E402

DATABASE = "hearth_bench_billing"
MONTH = datetime(2026, 11, 1, tzinfo=UTC)  # a closed month: the report reads only daily sums


def prepare_database(admin_url: str) -> str:
    import psycopg

    with psycopg.connect(f"{admin_url}/postgres", autocommit=True) as connection:
        connection.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        connection.execute(f"CREATE DATABASE {DATABASE}")
    return f"{admin_url}/{DATABASE}"


def seed(source: Path):
    """An org and key with a budget and rate limits far above what the run uses, and a priced
    tiny model: (org, key row, key secret, model)."""
    from controlplane.accounts.management.commands.demo import DEMO_PRICES
    from controlplane.accounts.models import ApiKey, Org
    from controlplane.catalog.models import Price, ServedModel

    org = Org.objects.create(slug="bench", name="Bench", monthly_budget_usd=Decimal("1000000"))
    model = ServedModel.objects.create(id="tiny-bench", source=str(source), context_length=256)
    Price.objects.create(model=model, **DEMO_PRICES, async_discount_percent=50)
    key, secret = ApiKey.objects.create_key(org, "bench")
    key.monthly_budget_usd = Decimal("1000000")
    key.requests_per_minute, key.tokens_per_minute = 10_000_000, 2_000_000_000
    key.save()
    return org, key, secret, model


def measure_billing(org, key, model, requests: int) -> dict[str, list[float]]:
    """Seconds per request: the rate limit, the reservation, the settlement, and their sum."""
    from django.db import transaction
    from django.utils import timezone

    from controlplane.billing import budgets
    from controlplane.billing.models import UsageRecord
    from controlplane.billing.pricing import max_cost
    from controlplane.dispatch.ratelimiting import take_rate_limit
    from controlplane.jobs.models import Job, new_request_id

    price = model.current_price()
    parts = ("rate_limit", "reserve", "settle", "total", "commits")
    samples = {part: [] for part in parts}
    for _ in range(requests):
        start = time.perf_counter()
        take_rate_limit(key, 40 + 200)
        limited = time.perf_counter()
        cost = max_cost(price, 40, 200, price.async_discount_percent)
        with transaction.atomic():
            reservation = budgets.reserve(org, key, cost, timezone.now())
            reserved = time.perf_counter()  # in production the job's commit follows anyway
        admitted = time.perf_counter()
        job = Job(
            org=org,
            api_key=key,
            created=timezone.now(),
            reserved_cost=reservation.cost,
            budget_scopes=reservation.scopes,
        )
        settling = time.perf_counter()
        with transaction.atomic():
            record = UsageRecord.objects.record(
                request_id=new_request_id(),
                org=org,
                api_key=key,
                model=model.id,
                mode=Job.ASYNC,
                prompt_tokens=40,
                cached_tokens=24,
                completion_tokens=120,
                price=price,
                discount_percent=price.async_discount_percent,
            )
            budgets.settle(job, record.total_cost)
            settled = time.perf_counter()  # as is the settling job's
        committed = time.perf_counter()
        samples["rate_limit"].append(limited - start)
        samples["reserve"].append(reserved - limited)
        samples["settle"].append(settled - settling)
        samples["total"].append(reserved - start + settled - settling)
        samples["commits"].append(admitted - start + committed - settling)
    return samples


def measure_admission_baseline(model, requests: int) -> list[float]:
    """Seconds of a whole admission of the same request by a key and org without limits."""
    import dramatiq

    from controlplane.accounts.models import ApiKey, Org
    from controlplane.dispatch.admission import admit

    org, _ = Org.objects.get_or_create(slug="bench-free", defaults={"name": "Unlimited"})
    _, secret = ApiKey.objects.create_key(org, "free")
    body = json.dumps(
        {"model": model.id, "prompt": "review this change, please", "max_tokens": 200}
        | {"queue": True}
    ).encode()
    samples = []
    for _ in range(requests):
        start = time.perf_counter()
        admit(f"Bearer {secret}", body, "completions", None, None)
        samples.append(time.perf_counter() - start)
    dramatiq.get_broker().flush_all()
    return samples


# Rows per INSERT (each its own transaction): the ledger's per-row trigger updates one daily row
# per row written, and many updates of one row in one transaction cost more than linearly.
CHUNK = 2000


def write_ledger(org, key, model, rows: int) -> float:
    """`rows` usage rows for `org` spread evenly over MONTH; seconds taken."""
    from django.db import connection

    from controlplane.billing.models import UsageRecord

    price = model.current_price()
    seconds = 30 * 24 * 3600
    start = time.perf_counter()
    with connection.cursor() as cursor:
        for first in range(0, rows, CHUNK):
            cursor.execute(
                f"""
                INSERT INTO {UsageRecord._meta.db_table}
                  (request_id, org_id, api_key_id, model, mode, prompt_tokens, cached_tokens,
                   completion_tokens, price_id, discount_percent, input_cost, cached_input_cost,
                   output_cost, total_cost, cache_savings, created)
                SELECT 'req_bench_' || n, %(org)s, %(key)s, %(model)s, 'async', 1000, 600, 200,
                       %(price)s, 50, 0.00012, 0.00003, 0.0003, 0.00045, 0.00015,
                       %(start)s::timestamptz
                         + (n::bigint * %(seconds)s / %(rows)s) * interval '1 second'
                FROM generate_series(%(first)s, %(last)s) AS n
                """,
                {
                    "org": org.pk,
                    "key": key.pk,
                    "model": model.id,
                    "price": price.pk,
                    "start": MONTH,
                    "seconds": seconds,
                    "rows": rows,
                    "first": first,
                    "last": min(first + CHUNK, rows) - 1,
                },
            )
        cursor.execute(f"ANALYZE {UsageRecord._meta.db_table}")
    return time.perf_counter() - start


def best_of(runs: int, work) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def ledger_grouping(org) -> list:
    """The month by day straight from the ledger: the report's work without the daily sums."""
    from django.db import connection

    from controlplane.billing.models import UsageRecord

    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            SELECT date_trunc('day', created AT TIME ZONE 'UTC') AS day, count(*),
                   sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens),
                   sum(input_cost), sum(cached_input_cost), sum(output_cost),
                   sum(total_cost), sum(cache_savings)
            FROM {UsageRecord._meta.db_table}
            WHERE org_id = %s AND created >= %s AND created < %s
            GROUP BY 1 ORDER BY 1
            """,
            [org.pk, MONTH, datetime(2026, 12, 1, tzinfo=UTC)],
        )
        return cursor.fetchall()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--postgres", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()

    setup_django(prepare_database(args.postgres), args.redis, f"hearth-bench-{os.getpid()}")
    import tempfile

    from controlplane.billing.reports import UsageReport
    from tests.inference.tiny_models import build_tiny_model

    org, key, _, model = seed(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", "llama"))
    log(f"admission and settlement: {args.requests} requests")
    measure_billing(org, key, model, 50)  # warm connections and scripts
    billing = measure_billing(org, key, model, args.requests)
    measure_admission_baseline(model, 50)
    baseline = measure_admission_baseline(model, min(args.requests, 500))

    log(f"writing {args.rows} ledger rows")
    write_s = write_ledger(org, key, model, args.rows)
    end = datetime(2026, 12, 1, tzinfo=UTC)
    report = UsageReport.build(org, MONTH, end, "day")
    assert report.total.requests == args.rows, report.total.requests
    report_s = best_of(5, lambda: UsageReport.build(org, MONTH, end, "day"))
    ledger_s = best_of(5, lambda: ledger_grouping(org))

    ms = 1000
    result = {
        "benchmark": "billing",
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "requests": args.requests,
        "admission_p50_ms": round(percentile(billing["total"], 50) * ms, 3),
        "admission_p99_ms": round(percentile(billing["total"], 99) * ms, 3),
        **{
            f"{part}_p50_ms": round(percentile(billing[part], 50) * ms, 3)
            for part in ("rate_limit", "reserve", "settle", "commits")
        },
        "baseline_admit_p50_ms": round(percentile(baseline, 50) * ms, 3),
        "rows": args.rows,
        "rows_written_s": round(write_s, 1),
        "report_month_ms": round(report_s * ms, 1),
        "baseline_ledger_group_ms": round(ledger_s * ms, 1),
    }
    table = [
        ("admission + settlement p50 (ms)", result["admission_p50_ms"], "<= 5"),
        ("admission + settlement p99 (ms)", result["admission_p99_ms"], ""),
        ("  rate limit (Redis) p50 (ms)", result["rate_limit_p50_ms"], ""),
        ("  reservation in 2 budgets p50 (ms)", result["reserve_p50_ms"], ""),
        ("  usage row + settlement p50 (ms)", result["settle_p50_ms"], ""),
        ("the same with their own 2 commits p50 (ms)", result["commits_p50_ms"], ""),
        ("baseline: whole admit() p50 (ms)", result["baseline_admit_p50_ms"], ""),
        ("month report by day (ms)", result["report_month_ms"], "<= 500"),
        ("baseline: GROUP BY day on the ledger (ms)", result["baseline_ledger_group_ms"], ""),
    ]
    print(f"{'metric':44} {'value':>10}  target")
    for name, value, target in table:
        print(f"{name:44} {value:>10}  {target}")
    out = REPO_ROOT / "bench" / "results" / "billing.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
