"""Gateway benchmark: what the control plane adds to a request over the engine's own time.

Starts Hearth's production mode as real processes (uvicorn, one `runnode`, the `rundramatiq`
worker) on PostgreSQL (database `hearth_bench`, created and migrated here) and Redis, serving a
tiny random-weight Llama, and measures:

- `added_p50_ms` / `added_p99_ms`: over N sequential non-streaming chat completions (8 tokens),
  the client's wall time minus the engine's own time for the same request (`timings.e2e_s`, from
  `add_request` to the last token, read back from the job). What remains is the control plane:
  HTTP, authentication, validation, chat template and tokenization, the Job row and its event,
  routing, the broker hop to the node, deltas back over the Redis channel layer, the response.
- `streams` / `stream_errors`: C concurrent streaming clients (the official `openai` package,
  `stream_options.include_usage`), each checked for its deltas, a finish reason, usage and the
  final `[DONE]`; also their time to first token and wall time.

The baseline is the engine's own time, measured in the same run (the table shows both). Prints a
table and, as the last line, one JSON object, also written to bench/results/gateway.json.

    .venv/bin/python bench/gateway.py                     # 300 requests, 100 streams
    .venv/bin/python bench/gateway.py --requests 50 --streams 20
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

DATABASE = "hearth_bench"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def prepare_database(admin_url: str) -> str:
    """A fresh `hearth_bench` database, migrated; returns its URL."""
    import psycopg

    with psycopg.connect(f"{admin_url}/postgres", autocommit=True) as connection:
        connection.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        connection.execute(f"CREATE DATABASE {DATABASE}")
    return f"{admin_url}/{DATABASE}"


def setup_django(database_url: str, redis_url: str, namespace: str) -> None:
    os.environ.update(
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        DATABASE_URL=database_url,
        REDIS_URL=redis_url,
        HEARTH_BROKER_NAMESPACE=namespace,
    )
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def seed(model_id: str, source: Path) -> str:
    from controlplane.accounts.management.commands.demo import DEMO_PRICES
    from controlplane.accounts.models import ApiKey, Org
    from controlplane.catalog.models import Price, ServedModel

    org = Org.objects.create(slug="bench", name="Bench")
    model = ServedModel.objects.create(id=model_id, source=str(source), context_length=256)
    Price.objects.create(model=model, **DEMO_PRICES)
    _, key = ApiKey.objects.create_key(org, "bench")
    return key


def start_stack(
    postgres: str,
    redis_url: str,
    max_num_seqs: int,
    node_threads: int | None,
    gateway_workers: int = 1,
    nice: int = 0,
):
    """Production mode on a fresh `hearth_bench` database, serving a tiny random Llama:
    (stack, API key, model id). The node is started; wait for it with `stack.wait_ready`.
    `nice` > 0 runs the node and the worker at that lower CPU priority."""
    namespace = f"hearth-bench-{os.getpid()}"
    database_url = prepare_database(postgres)
    setup_django(database_url, redis_url, namespace)
    from tests.e2e.stack import ProductionStack
    from tests.inference.tiny_models import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="hearth-bench-"))
    model_id = f"tiny-bench-{os.getpid()}"
    key = seed(model_id, build_tiny_model(work / "tiny", "llama"))
    stack = ProductionStack(database_url, redis_url, namespace, work)
    stack.start_gateway(gateway_workers)
    stack.start_worker(nice=nice)
    stack.start_node(
        model_id,
        "bench-node",
        "--max-num-seqs",
        str(max_num_seqs),
        threads=node_threads,
        nice=nice,
    )
    return stack, key, model_id


def stop_stack(stack, redis_url: str) -> None:
    """Stop the processes and delete the run's keys from Redis."""
    import redis

    stack.stop()
    client = redis.Redis.from_url(redis_url)
    for leftover in client.scan_iter(match=f"{stack.env['HEARTH_BROKER_NAMESPACE']}*"):
        client.delete(leftover)


def sequential_latency(port: int, key: str, model: str, count: int) -> list[tuple[str, float]]:
    """(request id, client seconds) of `count` requests on one keep-alive connection."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    samples = []
    for index in range(count):
        body = json.dumps(
            {
                "model": model,
                "messages": [{"role": "user", "content": f"request {index}: review this"}],
                "max_tokens": 8,
                "temperature": 0,
            }
        )
        start = time.perf_counter()
        connection.request("POST", "/v1/chat/completions", body, headers)
        response = connection.getresponse()
        payload = response.read()
        elapsed = time.perf_counter() - start
        if response.status != 200:
            raise RuntimeError(f"request {index}: {response.status} {payload[:300]!r}")
        samples.append((response.getheader("x-request-id"), elapsed))
    connection.close()
    return samples


def engine_seconds(request_ids: list[str], timeout_s: float = 60) -> dict[str, float]:
    """The engine's own e2e time per request, from the settled jobs."""
    from controlplane.jobs.models import Job

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        jobs = Job.objects.filter(request_id__in=request_ids, status=Job.COMPLETED)
        if jobs.count() == len(request_ids):
            return {j.request_id: j.result["timings"]["e2e_s"] for j in jobs}
        time.sleep(0.2)
    raise RuntimeError("not every benchmark request was settled by the worker")


def concurrent_streams(url: str, key: str, model: str, clients: int) -> dict:
    import openai

    barrier = threading.Barrier(clients)
    results: list[dict] = []
    lock = threading.Lock()

    def one(index: int) -> None:
        outcome = {"ok": False, "error": None, "ttft_s": None, "wall_s": None}
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
        try:
            barrier.wait()
            start = time.perf_counter()
            with client.chat.completions.with_streaming_response.create(
                model=model,
                messages=[{"role": "user", "content": f"stream {index}"}],
                max_tokens=16,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            ) as response:
                lines = []
                for line in response.iter_lines():
                    if not line:
                        continue  # the blank line that ends each SSE event
                    if '"content":"' in line and outcome["ttft_s"] is None:
                        outcome["ttft_s"] = time.perf_counter() - start
                    lines.append(line)
            outcome["wall_s"] = time.perf_counter() - start
            data = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            finished = [c for c in data if c["choices"] and c["choices"][0]["finish_reason"]]
            usage = data[-1].get("usage") if data else None
            deltas = sum(
                1 for c in data if c["choices"] and c["choices"][0]["delta"].get("content")
            )
            if lines[-1] != "data: [DONE]" or not finished or not usage or deltas < 1:
                outcome["error"] = f"incomplete stream: {lines[-3:]}"
            else:
                outcome["ok"] = usage["completion_tokens"] == 16 or (
                    finished[0]["choices"][0]["finish_reason"] == "stop"
                )
                if not outcome["ok"]:
                    outcome["error"] = f"usage {usage}"
        except Exception as error:  # every failure counts, whatever it is
            outcome["error"] = repr(error)
        with lock:
            results.append(outcome)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = [r["error"] for r in results if not r["ok"]]
    good = [r for r in results if r["ok"]]
    return {
        "streams": clients,
        "stream_errors": len(errors),
        "first_errors": errors[:3],
        "stream_ttft_p50_s": statistics.median(r["ttft_s"] for r in good) if good else None,
        "stream_wall_p50_s": statistics.median(r["wall_s"] for r in good) if good else None,
        "stream_wall_max_s": max(r["wall_s"] for r in good) if good else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--node-threads", type=int, default=1)
    parser.add_argument("--postgres", default="postgres://postgres@127.0.0.1:5432")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()

    # One torch thread for the node: on a 2-core machine its OpenMP threads would otherwise spin
    # on both cores and the figure would measure CPU contention, not the control plane (in a
    # deployment nodes run on machines of their own). --node-threads 0 leaves torch's default.
    stack, key, model_id = start_stack(
        args.postgres, args.redis, max(64, args.streams), args.node_threads or None
    )
    try:
        stack.wait_ready(model_id, nodes=1, api_key=key)
        log("warming up")
        sequential_latency(stack.port, key, model_id, 10)
        log(f"{args.requests} sequential requests")
        samples = sequential_latency(stack.port, key, model_id, args.requests)
        engine = engine_seconds([rid for rid, _ in samples])
        added_ms = [(wall - engine[rid]) * 1000 for rid, wall in samples]
        client_ms = [wall * 1000 for _, wall in samples]
        engine_ms = [engine[rid] * 1000 for rid, _ in samples]
        log(f"{args.streams} concurrent streams")
        streams = concurrent_streams(stack.url, key, model_id, args.streams)
    except Exception:
        log(stack.outputs())
        raise
    finally:
        stop_stack(stack, args.redis)

    result = {
        "benchmark": "gateway",
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "requests": args.requests,
        "added_p50_ms": round(statistics.median(added_ms), 2),
        "added_p99_ms": round(percentile(added_ms, 99), 2),
        "client_p50_ms": round(statistics.median(client_ms), 2),
        "engine_p50_ms": round(statistics.median(engine_ms), 2),
        "engine_p99_ms": round(percentile(engine_ms, 99), 2),
        **streams,
    }
    rows = [
        ("added_p50_ms", result["added_p50_ms"], result["engine_p50_ms"], "<= 15"),
        ("added_p99_ms", result["added_p99_ms"], result["engine_p99_ms"], "<= 60"),
        ("client_p50_ms", result["client_p50_ms"], result["engine_p50_ms"], ""),
        ("stream_errors", result["stream_errors"], f"of {result['streams']}", "0"),
        ("stream_ttft_p50_s", result["stream_ttft_p50_s"], "", ""),
        ("stream_wall_max_s", result["stream_wall_max_s"], "", ""),
    ]
    print(f"{'metric':<20}{'value':>12}{'baseline (engine)':>20}{'target':>10}")
    for name, value, baseline, target in rows:
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{name:<20}{shown:>12}{baseline!s:>20}{target:>10}")
    (REPO_ROOT / "bench" / "results").mkdir(exist_ok=True)
    (REPO_ROOT / "bench" / "results" / "gateway.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
