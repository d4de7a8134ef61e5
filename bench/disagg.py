"""Disaggregation benchmark: chats beside long prompts, colocated against prefill/decode split.

Runs, one after the other on this machine's 2 cores, two pairs of real node processes
(`python -m inference.node`, `OMP_NUM_THREADS=1` each) on Redis, serving SmolLM2-135M-Instruct:

- colocated: two `unified` nodes; every request on the shared queue `infer.<model>`;
- disagg: one `prefill` and one `decode` node; every request on `infer.<model>` (only the decode
  node pulls it), and a prompt whose uncached part is at least HEARTH_DISAGG_MIN_TOKENS (the
  gateway's rule, controlplane/dispatch/disaggregation.py) carries `prefill: {"queue": <the
  prefill node's own queue>}`, so its KV is computed there and written into the decode node's
  cache with the Mooncake Transfer Engine (TCP on loopback).

Both get the same seeded list of requests, sent open-loop on a fixed schedule (a slow
configuration does not get fewer requests): long prompts (2,000-4,000 random token ids, 16 new
tokens) at `--long-rate` per second, a share of them (`--repeat-share`) starting with the first
half of an earlier long prompt (a second question about the same document: the decode node
holds those blocks, so they are not moved), among `--chat-concurrency` chat users who each send
a turn (50-200 random tokens, 128 new tokens) every `--chat-period-s`. Greedy, `ignore_eos`.
Each request has its own reply channel; from the arrival times of its deltas the client takes
TTFT (enqueue to first delta) and TPOT ((last delta - first delta) / (tokens - 1)), and the gaps
between deltas (ITL, where a stall shows whole).

It prints, per request class and configuration, TTFT and TPOT at p50/p90/p99, the largest
inter-token gaps and the goodput (the share of the class's requests that met the stated latency
objective); for the split, the KV bytes and blocks moved per long request, the blocks not moved
because the decode node held them, and the transfer throughput from the prefill node's own
counters (bytes written / seconds in `write_blocks`, under load) against, measured in the same
run once the nodes are stopped, a direct KVTransfer write of the same blocks between two buffers
in one process, a torch copy of the same bytes in one thread, and a raw TCP loopback socket.

Checks: `lost` (requests without a `record_completion` result), `duplicates` (results beyond one
per request), `greedy_mismatches` (requests whose token ids differ between the two
configurations), `leaked_blocks` (once every hold has expired, each node's heartbeat
`num_blocks - free_blocks`, summed). In bfloat16 a request's greedy tokens can depend on what
shares its engine steps (chats that were never split differ too), so the mismatching requests
(up to `--max-references`) are run again alone in this process, and the report says whose
tokens that run reproduces. It also reports how busy the cores were with anything but the
nodes, this client and Redis: the figures are only worth reading from a quiet machine.

The last line of stdout is one JSON object, also written to bench/results/disagg.json.

    .venv/bin/python bench/disagg.py                  # 180 s of load per configuration
    .venv/bin/python bench/disagg.py --quick          # a short smoke run
    .venv/bin/python bench/disagg.py --long-rate 0.1 --chat-concurrency 6 --duration 300
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.gateway import log, percentile  # noqa: E402
from bench.job_queue import cpu_seconds, machine_busy_seconds, service_cpu_seconds  # noqa: E402

# SmolLM2's special tokens sit at the bottom of its vocabulary; random prompts stay above them.
FIRST_ORDINARY_TOKEN = 100
CHAT_TOKENS = (50, 200)
CHAT_NEW_TOKENS = 128
LONG_NEW_TOKENS = 16
HEARTBEAT_KEY = "hearth:node:"
LAST_SEEN_KEY = "hearth:node-seen:"


@dataclass
class Planned:
    """One request of the load: when it is sent (seconds from the start) and what it asks."""

    request_id: str
    kind: str  # "chat" or "long"
    at_s: float
    prompt: list[int]
    max_tokens: int
    # Prompt tokens the decode node is expected to hold (a repeated document's first half): the
    # gateway splits on the rest.
    expected_cached: int = 0


@dataclass
class Observed:
    """What the client saw of one request on its reply channel."""

    sent: float = 0.0
    delta_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    node: str | None = None
    prefill_node: str | None = None
    done: bool = False
    error: str | None = None

    @property
    def ttft_ms(self) -> float | None:
        return (self.delta_times[0] - self.sent) * 1000 if self.delta_times else None

    @property
    def tpot_ms(self) -> float | None:
        if len(self.token_ids) < 2:
            return None
        return (self.delta_times[-1] - self.delta_times[0]) * 1000 / (len(self.token_ids) - 1)

    @property
    def gaps_ms(self) -> list[float]:
        times = self.delta_times
        return [(b - a) * 1000 for a, b in itertools.pairwise(times)]


@dataclass
class Config:
    """A pair of nodes: (node id, role) each, and whether long prompts are split."""

    name: str
    nodes: list[tuple[str, str]]
    split: bool

    def node_of(self, role: str) -> str | None:
        return next((node for node, r in self.nodes if r == role), None)


# ---- the load ------------------------------------------------------------------------------


def vocabulary_size(model: str) -> int:
    from inference.models.loader import resolve_model_directory

    config = json.loads((resolve_model_directory(model) / "config.json").read_text())
    return int(config["vocab_size"])


def build_load(args: argparse.Namespace, vocab_size: int) -> list[Planned]:
    """The seeded request list both configurations get, in sending order."""
    rng = random.Random(args.seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(count)]

    load: list[Planned] = []
    for user in range(args.chat_concurrency):
        at = user * args.chat_period_s / args.chat_concurrency
        turn = 0
        while at < args.duration:
            prompt = tokens(rng.randint(*CHAT_TOKENS))
            load.append(Planned(f"chat-{user}-{turn}", "chat", at, prompt, CHAT_NEW_TOKENS))
            at += args.chat_period_s
            turn += 1
    longs: list[Planned] = []
    at = 0.5 / args.long_rate
    while at < args.duration:
        length = rng.randint(args.long_min_tokens, args.long_max_tokens)
        document: list[int] = []
        if longs and rng.random() < args.repeat_share:
            # A recent document: an old one's blocks may have left the decode node's cache.
            document = rng.choice(longs[-4:]).prompt[: length // 2]
        prompt = document + tokens(length - len(document))
        request = Planned(f"long-{len(longs)}", "long", at, prompt, LONG_NEW_TOKENS, len(document))
        longs.append(request)
        at += 1 / args.long_rate
    return sorted(load + longs, key=lambda p: p.at_s)


def generate_body(planned: Planned, reply_channel: str, prefill_queue: str | None) -> dict:
    """A `generate` message as the gateway sends it (inference/protocol/messages.py)."""
    return {
        "request_id": planned.request_id,
        "job_id": f"job-{planned.request_id}",
        "org": "bench",
        "prompt_token_ids": planned.prompt,
        "sampling": {
            "temperature": 0.0,
            "max_tokens": planned.max_tokens,
            "ignore_eos": True,
        },
        "reply_channel": reply_channel,
        "deadline": None,
        "attempt": 1,
        "prefill": {"queue": prefill_queue} if prefill_queue else None,
    }


# ---- the nodes -----------------------------------------------------------------------------


def start_node(
    node_id: str, role: str, served: str, namespace: str, prefix: str, args, log_dir: Path
) -> subprocess.Popen:
    """One node process, one thread, logging to `<log_dir>/<node_id>.log`."""
    argv = [
        sys.executable, "-m", "inference.node",
        "--model", served,
        "--source", args.model,
        "--role", role,
        "--node-id", node_id,
        "--redis-url", args.redis,
        "--broker-namespace", namespace,
        "--channel-prefix", prefix,
        "--dtype", args.dtype,
        "--max-num-seqs", str(args.max_num_seqs),
        "--kv-cache-mb", str(args.kv_cache_mb),
        "--kv-host", "127.0.0.1",
    ]  # fmt: skip
    if role == "decode":
        argv += ["--kv-wait-s", str(args.kv_wait_s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    output = (log_dir / f"{node_id}.log").open("w")
    return subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)


def heartbeat(client, node_id: str) -> dict | None:
    raw = client.get(HEARTBEAT_KEY + node_id)
    return json.loads(raw) if raw else None


def log_tail(log_dir: Path, node_id: str, lines: int = 30) -> str:
    path = log_dir / f"{node_id}.log"
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(text[-lines:])


def wait_ready(client, processes: dict[str, subprocess.Popen], log_dir: Path, timeout_s: float):
    """Every node beating; raises with its log's tail if one exits or none beats in time."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for node_id, process in processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"node {node_id} exited:\n{log_tail(log_dir, node_id)}")
        if all(heartbeat(client, node_id) for node_id in processes):
            return
        time.sleep(0.5)
    raise RuntimeError(f"nodes not ready after {timeout_s} s: {list(processes)}")


def wait_at_rest(client, node_ids: list[str], timeout_s: float) -> dict[str, dict]:
    """Each node's first heartbeat, written after this call began, that shows nothing running,
    waiting, awaiting KV or held (the decode node holds written blocks until their write
    deadline and a grace have passed). After `timeout_s`, the last heartbeats as they are."""
    since = time.time()
    deadline = since + timeout_s
    states: dict[str, dict] = {}
    while time.time() < deadline:
        states = {node_id: heartbeat(client, node_id) or {} for node_id in node_ids}
        if all(
            state.get("at", 0) > since
            and not any(state.get(k) for k in ("running", "waiting", "awaiting_kv"))
            and not state.get("held_blocks")
            for state in states.values()
        ):
            return states
        time.sleep(1)
    log(f"  nodes not at rest after {timeout_s:.0f} s: {states}")
    return states


def stop_nodes(processes: dict[str, subprocess.Popen]) -> None:
    """SIGTERM (the node drains), then SIGKILL whatever is left after 20 s."""
    for process in processes.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.time() + 20
    for process in processes.values():
        try:
            process.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def clean_redis(client, namespace: str, prefix: str, node_ids: list[str]) -> None:
    """Delete the run's broker queues, channels and heartbeat keys."""
    keys = [*client.scan_iter(match=f"{namespace}:*"), *client.scan_iter(match=f"{prefix}*")]
    keys += [k + node_id for node_id in node_ids for k in (HEARTBEAT_KEY, LAST_SEEN_KEY)]
    for start in range(0, len(keys), 500):
        client.delete(*keys[start : start + 500])


# ---- the client ----------------------------------------------------------------------------


async def drive(
    load: list[Planned],
    make_layer,
    broker,
    queue_for,
    prefill_for,
    wait_after_s: float,
) -> dict[str, Observed]:
    """Send each request at its time (open loop) on `queue_for(planned)`, with the prefill route
    `prefill_for(planned)` (None: not split), and read its reply channel until `done`; gives up
    on whatever has not finished `wait_after_s` after the last send. The channel layer comes
    from `make_layer()`: one per event loop, as its connections belong to the loop."""
    import dramatiq

    from inference.protocol.messages import GENERATE_ACTOR

    layer = make_layer()
    channels = {p.request_id: await layer.new_channel() for p in load}
    observed = {p.request_id: Observed() for p in load}
    start = time.perf_counter() + 0.5

    async def one(planned: Planned) -> None:
        seen = observed[planned.request_id]
        channel = channels[planned.request_id]
        await asyncio.sleep(max(0.0, start + planned.at_s - time.perf_counter()))
        message = dramatiq.Message(
            queue_name=queue_for(planned),
            actor_name=GENERATE_ACTOR,
            args=(generate_body(planned, channel, prefill_for(planned)),),
            kwargs={},
            options={},
        )
        seen.sent = time.perf_counter()
        broker.enqueue(message)
        while True:
            event = await layer.receive(channel)
            now = time.perf_counter()
            if event["type"] == "delta":
                seen.delta_times.append(now)
                seen.token_ids.extend(event["token_ids"])
                seen.node, seen.prefill_node = event["node"], event.get("prefill_node")
            elif event["type"] == "done":
                seen.done = True
                return
            else:
                seen.error = str(event.get("message") or event)
                return

    tasks = {asyncio.create_task(one(p)): p.request_id for p in load}
    last_send = max((p.at_s for p in load), default=0.0)
    _, pending = await asyncio.wait(tasks, timeout=last_send + 0.5 + wait_after_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task, request_id in tasks.items():
        if not task.cancelled() and task.exception() is not None:
            log(f"  client of {request_id} failed: {task.exception()} ({task.exception()!r})")
            observed[request_id].error = f"client: {task.exception()!r}"
    return observed


def collect_results(broker) -> dict[str, list[dict]]:
    """Every `record_completion` result the nodes sent, by request id (all of them: two for one
    request is a duplicate). Called once the nodes are at rest, so the queue holds them all."""
    from inference.protocol.messages import (
        CONTROLPLANE_QUEUE,
        RECORD_COMPLETION_ACTOR,
        results_of,
    )

    broker.declare_queue(CONTROLPLANE_QUEUE)
    consumer = broker.consume(CONTROLPLANE_QUEUE, prefetch=256, timeout=500)
    results: dict[str, list[dict]] = defaultdict(list)
    try:
        while (message := next(consumer)) is not None:
            if message.actor_name == RECORD_COMPLETION_ACTOR:
                for result in results_of(message.args[0]):
                    results[result.request_id].append(result.as_message())
            consumer.ack(message)
    finally:
        consumer.close()
    return results


def disagg_counters(states: dict[str, dict]) -> dict[str, dict]:
    return {node_id: dict(state.get("disagg") or {}) for node_id, state in states.items()}


def counter_delta(after: dict, before: dict) -> dict:
    return {name: value - before.get(name, 0) for name, value in after.items()}


def run_config(config: Config, load: list[Planned], args, served: str, work: Path) -> dict:
    """Start the pair, warm it, send the load, wait until every hold expired; what was seen."""
    import redis
    from channels_redis.core import RedisChannelLayer

    from inference.protocol.keyed_messages import KeyedRedisBroker
    from inference.protocol.messages import model_queue, node_queue, prefill_node_queue

    tag = f"hbd-{os.getpid()}-{config.name}"
    namespace, prefix = tag, f"{tag}-ch"
    node_ids = [node_id for node_id, _ in config.nodes]
    client = redis.Redis.from_url(args.redis)
    broker = KeyedRedisBroker(url=args.redis, namespace=namespace)
    log_dir = work / config.name
    log_dir.mkdir()
    processes: dict[str, subprocess.Popen] = {}
    prefill_id = config.node_of("prefill")
    prefill_route = prefill_node_queue(served, prefill_id) if prefill_id else None

    def split_route(planned: Planned) -> str | None:
        uncached = len(planned.prompt) - planned.expected_cached
        return prefill_route if config.split and uncached >= args.disagg_min_tokens else None

    try:
        for node_id, role in config.nodes:
            processes[node_id] = start_node(node_id, role, served, namespace, prefix, args, log_dir)
        log(f"{config.name}: starting {', '.join(f'{n} ({r})' for n, r in config.nodes)}")
        wait_ready(client, processes, log_dir, args.start_timeout)
        shared = model_queue(served)
        broker.declare_queue(shared)

        def make_layer() -> RedisChannelLayer:
            # A socket timeout above channels_redis's 5 s BRPOP (controlplane/settings.py says why).
            hosts = [{"address": args.redis, "socket_timeout": 30}]
            return RedisChannelLayer(hosts=hosts, prefix=prefix, capacity=10_000)

        # Warm-up, not measured: through each serving node's own queue, a chat and a prompt
        # long enough to be split, so first-call costs (allocations, the transfer engine's
        # first connection) stay out of the figures.
        rng = random.Random(-1)
        warm: list[Planned] = []
        warm_node: dict[str, str] = {}  # request id → the node whose own queue it goes to
        for node_id, role in config.nodes:
            if role == "prefill":
                continue
            for kind, length, new in (("chat", 60, 8), ("long", 700, 4)):
                prompt = [rng.randrange(FIRST_ORDINARY_TOKEN, 40_000) for _ in range(length)]
                warm.append(Planned(f"warm-{node_id}-{kind}", kind, 0.0, prompt, new))
                warm_node[warm[-1].request_id] = node_id
        log(f"{config.name}: warming up")
        warmed = asyncio.run(
            drive(
                warm,
                make_layer,
                broker,
                lambda p: node_queue(served, warm_node[p.request_id]),
                lambda p: split_route(p) if p.kind == "long" else None,
                args.drain_timeout,
            )
        )
        if not all(seen.done for seen in warmed.values()):
            raise RuntimeError(f"warm-up did not finish: {warmed}")
        time.sleep(2.5)  # a heartbeat after the warm-up's counters changed
        before = disagg_counters({n: heartbeat(client, n) or {} for n in node_ids})

        pids = {node_id: [process.pid] for node_id, process in processes.items()}
        cpu_before = {node_id: cpu_seconds(p) for node_id, p in pids.items()}
        machine_before, redis_before = (
            machine_busy_seconds(),
            service_cpu_seconds(("redis-server",)),
        )
        client_before, wall_before = time.process_time(), time.perf_counter()
        log(
            f"{config.name}: sending {len(load)} requests over {args.duration:.0f} s "
            f"({sum(p.kind == 'long' for p in load)} long, "
            f"{sum(p.kind == 'chat' for p in load)} chat)"
        )
        observed = asyncio.run(
            drive(load, make_layer, broker, lambda p: shared, split_route, args.drain_timeout)
        )
        wall = time.perf_counter() - wall_before
        node_cpu = {node_id: cpu_seconds(p) - cpu_before[node_id] for node_id, p in pids.items()}
        client_cpu = time.process_time() - client_before
        redis_cpu = service_cpu_seconds(("redis-server",)) - redis_before
        machine = machine_busy_seconds() - machine_before
        others = machine - sum(node_cpu.values()) - client_cpu - redis_cpu

        log(f"{config.name}: waiting for the nodes to come to rest (holds expire)")
        states = wait_at_rest(client, node_ids, args.kv_wait_s + 30)
        after = disagg_counters(states)
        results = collect_results(broker)
        for node_id, process in processes.items():
            if process.poll() is not None:
                log(f"  node {node_id} exited early:\n{log_tail(log_dir, node_id)}")
    finally:
        stop_nodes(processes)
        clean_redis(client, namespace, prefix, node_ids)
        broker.close()
        client.close()
    return {
        "config": config,
        "observed": observed,
        "results": results,
        "states": states,
        "counters": {n: counter_delta(after[n], before.get(n, {})) for n in node_ids},
        "cpu": {
            "wall_s": round(wall, 1),
            "node_cores": {n: round(s / wall, 2) for n, s in node_cpu.items()},
            "client_cores": round(client_cpu / wall, 2),
            "redis_cores": round(redis_cpu / wall, 2),
            "other_cores": round(others / wall, 2),
        },
        "log_dir": str(log_dir),
    }


# ---- the figures ---------------------------------------------------------------------------


def class_figures(load: list[Planned], run: dict, kind: str, slo: tuple[float, float]) -> dict:
    """TTFT, TPOT and the largest gaps of one request class, and its goodput under `slo`
    (TTFT ms, TPOT ms): the share of the class's requests, lost ones included, that met both."""
    seen = [run["observed"][p.request_id] for p in load if p.kind == kind]
    finished = [s for s in seen if s.done and s.ttft_ms is not None]
    ttft = [s.ttft_ms for s in finished]
    tpot = [s.tpot_ms for s in finished if s.tpot_ms is not None]
    gaps = [gap for s in finished for gap in s.gaps_ms]
    good = sum(
        1 for s in finished if s.ttft_ms <= slo[0] and (s.tpot_ms is None or s.tpot_ms <= slo[1])
    )

    def at(values: list[float], q: float) -> float | None:
        return round(percentile(values, q), 1) if values else None

    return {
        "requests": len(seen),
        "finished": len(finished),
        **{f"ttft_p{q}_ms": at(ttft, q) for q in (50, 90, 99)},
        **{f"tpot_p{q}_ms": at(tpot, q) for q in (50, 90, 99)},
        "itl_p99_ms": at(gaps, 99),
        "itl_max_ms": round(max(gaps), 1) if gaps else None,
        "goodput": round(good / len(seen), 3) if seen else None,
    }


def checks(load: list[Planned], run: dict) -> dict:
    """lost, duplicates, errors, and streams whose tokens differ from their recorded result."""
    results, observed = run["results"], run["observed"]
    lost = [p.request_id for p in load if not results.get(p.request_id)]
    duplicates = sum(
        len(results.get(p.request_id, [])) - 1 for p in load if results.get(p.request_id)
    )
    errors = [
        p.request_id
        for p in load
        if observed[p.request_id].error
        or any(r.get("error") for r in results.get(p.request_id, []))
    ]
    unfinished = [p.request_id for p in load if not observed[p.request_id].done]
    stream_mismatches = [
        p.request_id
        for p in load
        if results.get(p.request_id)
        and observed[p.request_id].done
        and observed[p.request_id].token_ids != results[p.request_id][0]["token_ids"]
    ]
    short = [
        p.request_id
        for p in load
        if results.get(p.request_id) and len(results[p.request_id][0]["token_ids"]) != p.max_tokens
    ]
    return {
        "lost": len(lost),
        "duplicates": duplicates,
        "errors": len(errors),
        "streams_unfinished": len(unfinished),
        "stream_result_mismatches": len(stream_mismatches),
        "wrong_token_counts": len(short),
        "leaked_blocks": sum(
            s.get("num_blocks", 0) - s.get("free_blocks", 0) for s in run["states"].values()
        ),
        "examples": {
            "lost": lost[:5],
            "errors": errors[:5],
            "unfinished": unfinished[:5],
            "stream_result_mismatches": stream_mismatches[:5],
            "wrong_token_counts": short[:5],
        },
    }


def greedy_mismatches(load: list[Planned], first: dict, second: dict) -> list[dict]:
    """Requests both configurations answered whose token ids differ, with where they part."""
    mismatches = []
    for planned in load:
        a, b = first["results"].get(planned.request_id), second["results"].get(planned.request_id)
        if not a or not b or a[0]["token_ids"] == b[0]["token_ids"]:
            continue
        left, right = a[0]["token_ids"], b[0]["token_ids"]
        at = next((i for i, (x, y) in enumerate(zip(left, right, strict=False)) if x != y), None)
        mismatches.append(
            {
                "request_id": planned.request_id,
                "first_difference": min(len(left), len(right)) if at is None else at,
                "split": b[0].get("prefill_node") is not None,
                "colocated_node": a[0].get("node"),
                "colocated_cached_tokens": a[0]["usage"]["cached_tokens"],
                "disagg_cached_tokens": b[0]["usage"]["cached_tokens"],
                "colocated_token_ids": left,
                "disagg_token_ids": right,
            }
        )
    return mismatches


def attribute_mismatches(
    load: list[Planned], mismatches: list[dict], args: argparse.Namespace
) -> dict[str, int]:
    """Run the first `--max-references` mismatching requests alone, each in a fresh engine
    namespace of one engine in this process (one thread, as a node), and count which
    configuration's tokens equal that run's. Where bfloat16 results depend on what else shares
    a step (the matmul shapes), requests that were never split also differ; a split request
    whose disagg tokens equal its run alone was not changed by moving its KV."""
    import torch

    from inference.engine import EngineConfig, LLMEngine, SamplingParams

    counts = {"checked": 0, "disagg_equals_alone": 0, "colocated_equals_alone": 0, "neither": 0}
    if not mismatches:
        return counts
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype))
    planned = {p.request_id: p for p in load}
    for mismatch in mismatches[: args.max_references]:
        request = planned[mismatch["request_id"]]
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(
            request.request_id, request.prompt, params, namespace=f"alone-{request.request_id}"
        )
        alone: list[int] = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                alone.extend(output.token_ids)
        mismatch["alone_token_ids"] = alone
        disagg_equal = alone == mismatch["disagg_token_ids"]
        colocated_equal = alone == mismatch["colocated_token_ids"]
        mismatch["equals_alone"] = (
            "disagg" if disagg_equal else "colocated" if colocated_equal else "neither"
        )
        counts["checked"] += 1
        counts["disagg_equals_alone"] += disagg_equal
        counts["colocated_equals_alone"] += colocated_equal
        counts["neither"] += not (disagg_equal or colocated_equal)
    return counts


# What a prefill node logs when a prompt's KV does not reach the decode node
# (inference/disagg/prefill_node.py).
PREFILL_LOG_EVENTS = {
    "write_failures": "could not write the KV of",
    "too_late_to_write": "too late to write",
    "late_prefills_dropped": "late prefill of",
}


def split_figures(load: list[Planned], run: dict) -> dict:
    """What the split moved, from the nodes' heartbeat counters (the load only: the warm-up's
    are subtracted), and the prefill node's log lines of KV that never arrived."""
    config: Config = run["config"]
    prefill_log = Path(run["log_dir"]) / f"{config.node_of('prefill')}.log"
    lines = prefill_log.read_text(errors="replace").splitlines() if prefill_log.exists() else []
    prefill = run["counters"][config.node_of("prefill")]
    decode = run["counters"][config.node_of("decode")]
    split = [
        p for p in load if run["results"].get(p.request_id)
        and run["results"][p.request_id][0].get("prefill_node")
    ]  # fmt: skip
    requests = max(1, prefill.get("requests", 0))
    seconds = prefill.get("transfer_seconds", 0.0)
    return {
        "split_requests": len(split),
        "prefill_requests": prefill.get("requests", 0),
        "kv_bytes_per_request": round(prefill.get("bytes_transferred", 0) / requests),
        "kv_blocks_per_request": round(prefill.get("blocks_transferred", 0) / requests, 1),
        "blocks_reused": decode.get("blocks_reused", 0),
        "blocks_reused_per_request": round(
            decode.get("blocks_reused", 0) / max(1, decode.get("requests", 0)), 1
        ),
        "fallbacks": decode.get("fallbacks", 0),
        **{name: sum(text in line for line in lines) for name, text in PREFILL_LOG_EVENTS.items()},
        "transfer_ms_per_request": round(seconds * 1000 / requests, 2),
        "transfer_gb_s": round(prefill.get("bytes_transferred", 0) / seconds / 1e9, 3)
        if seconds
        else None,
    }


# ---- the baselines -------------------------------------------------------------------------


def loopback_tcp_gb_s(nbytes: int, repeats: int = 3) -> float:
    """A raw TCP loopback socket: one `sendall` of `nbytes` to a receiver thread that
    `recv_into`s a preallocated buffer; the median over `repeats`, in GB/s."""
    payload = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes >> 20))
    sink = bytearray(len(payload))
    rates = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        for _ in range(repeats):
            sender = socket.create_connection(("127.0.0.1", port))
            receiver, _ = server.accept()

            def receive(connection: socket.socket = receiver) -> None:
                view, got = memoryview(sink), 0
                while got < len(sink):
                    count = connection.recv_into(view[got:])
                    if not count:
                        break
                    got += count

            thread = threading.Thread(target=receive)
            thread.start()
            started = time.perf_counter()
            sender.sendall(payload)
            thread.join()
            rates.append(len(payload) / (time.perf_counter() - started) / 1e9)
            sender.close()
            receiver.close()
    return statistics.median(rates)


def torch_copy_gb_s(nbytes: int, repeats: int = 7) -> float:
    """`dst.copy_(src)` of `nbytes` in this process, one thread (as each node has): the
    median, in GB/s."""
    import torch

    torch.set_num_threads(1)
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    destination = torch.empty_like(source)
    destination.copy_(source)
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        destination.copy_(source)
        rates.append(nbytes / (time.perf_counter() - started) / 1e9)
    return statistics.median(rates)


def kv_transfer_gb_s(layout: dict, blocks: int, repeats: int = 5) -> tuple[float, int]:
    """A direct KVTransfer write of `blocks` blocks (every layer, keys and values) between two
    caches laid out as the nodes' in this one process, over the same TCP transport: the median
    rate in GB/s and the bytes of one write. Checks that the blocks arrived intact."""
    import torch

    from inference.disagg.layout import KVLayout
    from inference.disagg.transfer import KVTransfer

    kv_layout = KVLayout.from_dict(layout)
    dtype = {"float32": torch.float32}.get(kv_layout.dtype, torch.bfloat16)
    shape = (
        kv_layout.num_layers, 2, blocks + 8, kv_layout.block_size,
        kv_layout.num_kv_heads, kv_layout.head_dim,
    )  # fmt: skip
    source = torch.randn(shape).to(dtype)
    destination = torch.zeros(shape, dtype=dtype)
    ours, theirs = KVTransfer(source, kv_layout), KVTransfer(destination, kv_layout)
    ids = list(range(blocks))
    ours.write_blocks(theirs.region, ids, ids)  # the first connection is not measured
    if not torch.equal(destination[:, :, :blocks], source[:, :, :blocks]):
        raise RuntimeError("the in-process KVTransfer write did not copy the blocks intact")
    rates, nbytes = [], 0
    for _ in range(repeats):
        stats = ours.write_blocks(theirs.region, ids, ids)
        rates.append(stats.bytes / stats.seconds / 1e9)
        nbytes = stats.bytes
    return statistics.median(rates), nbytes


# ---- the report ----------------------------------------------------------------------------


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def print_class_table(kind: str, slo: tuple[float, float], figures: dict[str, dict]) -> None:
    print(f"\n{kind} requests (objective: TTFT <= {slo[0]:,.0f} ms and TPOT <= {slo[1]:,.0f} ms)")
    header = ["config", "n", "TTFT p50", "p90", "p99", "TPOT p50", "p90", "p99"]
    header += ["ITL p99", "max", "goodput"]
    print("".join(f"{h:>10}" if i else f"{h:<11}" for i, h in enumerate(header)) + "   (ms)")
    for name, f in figures.items():
        cells = [f"{f['finished']}/{f['requests']}"]
        cells += [fmt(f[f"ttft_p{q}_ms"]) for q in (50, 90, 99)]
        cells += [fmt(f[f"tpot_p{q}_ms"]) for q in (50, 90, 99)]
        cells += [fmt(f["itl_p99_ms"]), fmt(f["itl_max_ms"])]
        cells += ["-" if f["goodput"] is None else f"{f['goodput']:.0%}"]
        print(f"{name:<11}" + "".join(f"{c:>10}" for c in cells))


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=180, help="seconds of arrivals")
    parser.add_argument("--long-rate", type=float, default=0.125, help="long prompts per second")
    parser.add_argument("--chat-concurrency", type=int, default=4, help="chat users")
    parser.add_argument(
        "--chat-period-s", type=float, default=8, help="each chat user sends a turn this often"
    )
    parser.add_argument("--long-min-tokens", type=int, default=2000)
    parser.add_argument("--long-max-tokens", type=int, default=4000)
    parser.add_argument(
        "--repeat-share",
        type=float,
        default=0.25,
        help="share of long prompts that begin with an earlier one's first half",
    )
    parser.add_argument("--seed", type=int, default=24)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="the nodes' --source")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    parser.add_argument(
        "--kv-wait-s",
        type=float,
        default=30,
        help="the decode node's KV wait: past it a prompt is asked again, then prefilled there",
    )
    parser.add_argument(
        "--disagg-min-tokens",
        type=int,
        default=int(os.environ.get("HEARTH_DISAGG_MIN_TOKENS", 512)),
        help="split a prompt whose uncached part has at least this many tokens",
    )
    parser.add_argument("--slo-chat-ttft-ms", type=float, default=1000)
    parser.add_argument("--slo-chat-tpot-ms", type=float, default=100)
    parser.add_argument("--slo-long-ttft-ms", type=float, default=10_000)
    parser.add_argument("--slo-long-tpot-ms", type=float, default=100)
    parser.add_argument(
        "--max-references",
        type=int,
        default=20,
        help="greedy mismatches to run alone in this process, to tell numerics from the split",
    )
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument("--drain-timeout", type=float, default=300, help="wait after the last send")
    parser.add_argument("--tcp-mb", type=int, default=256, help="bytes of the TCP loopback run")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.long_rate, args.chat_concurrency = 20, 0.15, 2
        args.repeat_share = 0.5
        args.drain_timeout = min(args.drain_timeout, 120)

    load = build_load(args, vocabulary_size(args.model))
    served = f"bench-disagg-{os.getpid()}"
    work = Path(tempfile.mkdtemp(prefix="hearth-bench-disagg-"))
    log(f"node logs under {work}")
    pid = os.getpid()
    configs = [
        Config("colocated", [(f"bd{pid}-unified-1", "unified"), (f"bd{pid}-unified-2", "unified")],
               split=False),
        Config("disagg", [(f"bd{pid}-prefill-1", "prefill"), (f"bd{pid}-decode-1", "decode")],
               split=True),
    ]  # fmt: skip
    runs = {config.name: run_config(config, load, args, served, work) for config in configs}
    colocated, disagg = runs["colocated"], runs["disagg"]

    split = split_figures(load, disagg)
    log("baselines: raw TCP loopback, torch copy, in-process KVTransfer")
    layout = next(s for s in disagg["states"].values() if s.get("kv_layout"))["kv_layout"]
    blocks = max(1, round(split["kv_blocks_per_request"]))
    kv_gb_s, kv_bytes = kv_transfer_gb_s(layout, blocks)
    loopback = loopback_tcp_gb_s(args.tcp_mb << 20)
    copy = torch_copy_gb_s(max(1, split["kv_bytes_per_request"] or kv_bytes))

    slos = {
        "chat": (args.slo_chat_ttft_ms, args.slo_chat_tpot_ms),
        "long": (args.slo_long_ttft_ms, args.slo_long_tpot_ms),
    }
    figures = {
        kind: {name: class_figures(load, run, kind, slos[kind]) for name, run in runs.items()}
        for kind in ("chat", "long")
    }
    verdicts = {name: checks(load, run) for name, run in runs.items()}
    mismatches = greedy_mismatches(load, colocated, disagg)
    if mismatches:
        log(f"running {min(len(mismatches), args.max_references)} mismatching requests alone")
    attribution = attribute_mismatches(load, mismatches, args)

    for kind in ("chat", "long"):
        print_class_table(kind, slos[kind], figures[kind])

    print(
        f"\nsplit (disagg): {split['split_requests']} long requests computed by the prefill node"
        f" ({split['fallbacks']} fell back to a local prefill)"
    )
    print(
        f"  KV that never arrived     {split['write_failures']} failed writes, "
        f"{split['too_late_to_write']} computed too late, "
        f"{split['late_prefills_dropped']} taken too late (prefill node's log)"
    )
    print(
        f"  KV moved per request      {split['kv_bytes_per_request'] / 1e6:,.1f} MB, "
        f"{split['kv_blocks_per_request']} blocks, {split['transfer_ms_per_request']} ms"
    )
    print(
        f"  blocks not moved (held)   {split['blocks_reused']} in all, "
        f"{split['blocks_reused_per_request']} per request"
    )
    print("  transfer throughput                                    GB/s")
    rows = [
        ("prefill node's counters (under load)", split["transfer_gb_s"]),
        (f"KVTransfer in one process ({kv_bytes / 1e6:,.1f} MB)", kv_gb_s),
        ("torch copy, one thread (same bytes)", copy),
        (f"raw TCP loopback ({args.tcp_mb} MB sendall)", loopback),
    ]
    for label, value in rows:
        print(f"    {label:<50}{fmt(value):>8}")

    print(f"\n{'checks':<28}{'colocated':>10}{'disagg':>10}")
    for name in (
        "lost",
        "duplicates",
        "errors",
        "streams_unfinished",
        "stream_result_mismatches",
        "wrong_token_counts",
        "leaked_blocks",
    ):
        print(f"  {name:<26}{verdicts['colocated'][name]:>10}{verdicts['disagg'][name]:>10}")
    split_mismatches = sum(m["split"] for m in mismatches)
    print(
        f"  greedy_mismatches (colocated vs disagg): {len(mismatches)}: {split_mismatches} split, "
        f"{len(mismatches) - split_mismatches} never split (those differ only in what shared "
        "their steps)"
    )
    if attribution["checked"]:
        print(
            f"    run alone in one engine ({attribution['checked']} checked): "
            f"{attribution['disagg_equals_alone']} equal disagg's tokens, "
            f"{attribution['colocated_equals_alone']} colocated's, {attribution['neither']} neither"
        )
    for mismatch in mismatches[:5]:
        shown = {k: v for k, v in mismatch.items() if not k.endswith("token_ids")}
        print(f"    {shown}")
    for name, run in runs.items():
        cpu = run["cpu"]
        print(
            f"cores busy, {name}: nodes {cpu['node_cores']}, client {cpu['client_cores']}, "
            f"redis {cpu['redis_cores']}, anything else {cpu['other_cores']}"
            + ("  <- not a quiet machine" if cpu["other_cores"] > 0.2 else "")
        )

    chat_c, chat_d = figures["chat"]["colocated"], figures["chat"]["disagg"]
    long_c, long_d = figures["long"]["colocated"], figures["long"]["disagg"]
    total = {
        name: sum(verdicts[c][name] for c in runs)
        for name in ("lost", "duplicates", "leaked_blocks")
    }
    result = {
        "benchmark": "disagg",
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": args.model,
        "dtype": args.dtype,
        "duration_s": args.duration,
        "long_rate": args.long_rate,
        "chat_concurrency": args.chat_concurrency,
        "chat_period_s": args.chat_period_s,
        "repeat_share": args.repeat_share,
        "requests": {"chat": chat_c["requests"], "long": long_c["requests"]},
        "slo": {kind: {"ttft_ms": s[0], "tpot_ms": s[1]} for kind, s in slos.items()},
        "chat_tpot_p90_ms_colocated": chat_c["tpot_p90_ms"],
        "chat_tpot_p90_ms_disagg": chat_d["tpot_p90_ms"],
        "chat_ttft_p50_ms_colocated": chat_c["ttft_p50_ms"],
        "chat_ttft_p50_ms_disagg": chat_d["ttft_p50_ms"],
        "long_ttft_p50_ms_colocated": long_c["ttft_p50_ms"],
        "long_ttft_p50_ms_disagg": long_d["ttft_p50_ms"],
        "transfer_gb_s": split["transfer_gb_s"],
        "loopback_tcp_gb_s": round(loopback, 3),
        "kv_transfer_in_process_gb_s": round(kv_gb_s, 3),
        "torch_copy_gb_s": round(copy, 3),
        "lost": total["lost"],
        "duplicates": total["duplicates"],
        "greedy_mismatches": len(mismatches),
        "leaked_blocks": total["leaked_blocks"],
        "greedy_mismatches_split": split_mismatches,
        "greedy_mismatch_attribution": attribution,
        "greedy_mismatch_details": mismatches,
        "split": split,
        "classes": figures,
        "checks": verdicts,
        "cpu": {name: run["cpu"] for name, run in runs.items()},
        "served_by": {
            name: dict(Counter(s.node for s in run["observed"].values() if s.node))
            for name, run in runs.items()
        },
    }

    targets = [
        (
            "chat p90 TPOT disagg / colocated",
            ratio(chat_d["tpot_p90_ms"], chat_c["tpot_p90_ms"]),
            "<= 0.333",
            lambda v: v <= 1 / 3,
        ),
        (
            "chat p50 TTFT disagg / colocated",
            ratio(chat_d["ttft_p50_ms"], chat_c["ttft_p50_ms"]),
            "<= 1.5",
            lambda v: v <= 1.5,
        ),
        (
            "transfer / raw TCP loopback",
            ratio(split["transfer_gb_s"], loopback),
            ">= 0.5",
            lambda v: v >= 0.5,
        ),
        ("lost", total["lost"], "0", lambda v: v == 0),
        ("duplicates", total["duplicates"], "0", lambda v: v == 0),
        ("greedy_mismatches", len(mismatches), "0", lambda v: v == 0),
        ("leaked_blocks", total["leaked_blocks"], "0", lambda v: v == 0),
    ]
    print(f"\n{'target':<36}{'value':>10}{'target':>10}{'met':>6}")
    met = {}
    for label, value, target, passes in targets:
        met[label] = value is not None and passes(value)
        print(f"{label:<36}{fmt(value):>10}{target:>10}{'yes' if met[label] else 'no':>6}")
    result["targets_met"] = met

    (REPO_ROOT / "bench" / "results").mkdir(exist_ok=True)
    (REPO_ROOT / "bench" / "results" / "disagg.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
