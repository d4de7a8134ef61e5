"""Hearth's production mode as real processes: uvicorn (the gateway), `manage.py runnode` (one
or more nodes), `manage.py rundramatiq` (the control plane's worker) and `manage.py sweepjobs`,
against PostgreSQL and Redis, each started from its line of deploy/Procfile, so the deployment
guide runs what the tests run. Used by the multi-process tests and by bench/."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from deploy.procfile import command_argv, read_procfile

ROOT = Path(__file__).resolve().parents[2]
PROCFILE = read_procfile()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProductionStack:
    """Start each process with its `start_…`, stop them all with `stop()`; `output()` returns the
    end of a process's log, `log()` all of it. `env` is every process's environment: the
    Procfile's variables are the stack's (a free port, small pools, a small KV cache, the worker's
    /metrics on a free port), and a test may change any before it starts a process."""

    def __init__(self, database_url: str, redis_url: str, namespace: str, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.worker_metrics_port = free_port()  # the worker's /metrics
        self.log_dir = log_dir
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "DATABASE_URL": database_url,
            "REDIS_URL": redis_url,
            "HEARTH_BROKER_NAMESPACE": namespace,
            "HEARTH_CHANNEL_PREFIX": f"{namespace}-asgi",
            "HEARTH_ALLOWED_HOSTS": "127.0.0.1,localhost",
            "PYTHONUNBUFFERED": "1",
            "HEARTH_GATEWAY_HOST": "127.0.0.1",
            "HEARTH_GATEWAY_PORT": str(self.port),
            "HEARTH_GATEWAY_PROCESSES": "1",
            "HEARTH_WORKER_PROCESSES": "1",
            "HEARTH_WORKER_THREADS": "4",
            "HEARTH_SWEEP_EVERY_S": "1",
            "HEARTH_NODE_DTYPE": "float32",
            "HEARTH_NODE_MAX_NUM_SEQS": "64",
            "HEARTH_NODE_KV_CACHE_MB": "16",
            "HEARTH_NODE_ROLE": "unified",
            "HEARTH_NODE_KV_HOST": "127.0.0.1",
            "HEARTH_NODE_KV_WAIT_S": "30",
            "HEARTH_WORKER_METRICS_PORT": str(self.worker_metrics_port),
        }
        self.processes: dict[str, subprocess.Popen] = {}

    def _spawn(self, name: str, argv: list[str], nice: int = 0, **env: str) -> subprocess.Popen:
        """Start a process logging to `<name>.log`; `nice` > 0 lowers its CPU priority."""
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        process = subprocess.Popen(
            ["nice", "-n", str(nice), *argv] if nice else argv,
            cwd=ROOT,
            env={**self.env, **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.processes[name] = process
        return process

    def _start(
        self, process: str, name: str, *extra: str, nice: int = 0, **env: str
    ) -> subprocess.Popen:
        """deploy/Procfile's `process` line under `name`, with the stack's environment and `env`;
        `extra` arguments go after the line's own (for argparse, the last of an option wins)."""
        argv = command_argv(PROCFILE[process], {**self.env, **env})
        if argv[0] == "python":  # the Procfile's: the virtual environment's Python
            argv[0] = sys.executable
        return self._spawn(name, [*argv, *extra], nice, **env)

    def start_gateway(self, workers: int = 1) -> None:
        """uvicorn; `workers` > 1 runs that many gateway processes on the one port."""
        self._start("gateway", "gateway", HEARTH_GATEWAY_PROCESSES=str(workers))

    def start_worker(self, nice: int = 0) -> None:
        self._start("worker", "worker", nice=nice)

    def start_sweeper(self, every_s: float = 1.0, grace_s: float = 3.0) -> None:
        """`manage.py sweepjobs --every`: expiry, and what the broker lost sent again."""
        self._start(
            "sweeper",
            "sweeper",
            HEARTH_SWEEP_EVERY_S=str(every_s),
            HEARTH_JOB_REDELIVERY_GRACE_S=str(grace_s),
        )

    def start_node(
        self, model: str, node_id: str, *extra: str, threads: int | None = None, nice: int = 0
    ) -> None:
        """A node process; `threads` caps its torch/OpenMP threads (default: torch's choice);
        `extra`: more `runnode` options (`--max-num-seqs 8` overrides the stack's)."""
        env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
        self._start(
            "node",
            f"node-{node_id}",
            *extra,
            nice=nice,
            HEARTH_NODE_MODEL=model,
            HEARTH_NODE_ID=node_id,
            **env,
        )

    def redis(self):
        """A client of the stack's Redis."""
        import redis

        return redis.Redis.from_url(self.env["REDIS_URL"])

    def broker_key(self, queue: str) -> str:
        """The Redis key of the broker's `queue` (its list of waiting message ids; `.msgs`
        appended, its hash of messages)."""
        return f"{self.env['HEARTH_BROKER_NAMESPACE']}:{queue}"

    def wait_ready(self, model: str, nodes: int, api_key: str, timeout_s: float = 120) -> None:
        """Until the gateway answers and `nodes` nodes of `model` heartbeat."""
        from inference.protocol.heartbeat import NODE_KEY_PREFIX

        client = self.redis()
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited early:\n{self.output(name)}")
            try:
                urllib.request.urlopen(f"{self.url}/healthz", timeout=2)
                live = [
                    k
                    for k in client.scan_iter(match=NODE_KEY_PREFIX + "*")
                    if model.encode() in (client.get(k) or b"")
                ]
                if len(live) >= nodes:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"stack not ready in {timeout_s} s:\n{self.outputs()}")

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def output(self, name: str) -> str:
        return self.log(name)[-4000:]

    def log(self, name: str) -> str:
        """Everything process `name` wrote so far (stdout and stderr)."""
        path = self.log_dir / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def outputs(self) -> str:
        return "\n".join(f"--- {name}\n{self.output(name)}" for name in self.processes)


class RedisServer:
    """A redis-server of the test's own on a free port, without persistence, as CI runs the
    shared one: `restart()` loses everything it held, as a crashed Redis does."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_dir = log_dir
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.log_dir),
                "--logfile",
                str(self.log_dir / "redis.log"),
            ]
        )
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"redis-server on port {self.port} did not start")

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()


class EmbeddedServer:
    """`manage.py serve` (embedded mode: SQLite, in-process worker and node) in a subprocess,
    on a fresh data directory, serving one tiny model as `model_id`."""

    def __init__(self, data_dir: Path, model_id: str, model_source: Path, *serve_args: str) -> None:
        self.serve_args = serve_args  # more `manage.py serve` options (`--disaggregated`)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir = data_dir
        self.env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("DATABASE_URL", "REDIS_URL", "BROKER_URL")
        }
        self.env.update(
            DJANGO_SETTINGS_MODULE="controlplane.settings",
            HEARTH_DATA_DIR=str(data_dir),
            HEARTH_ALLOWED_HOSTS="127.0.0.1,localhost",
            HEARTH_CSRF_TRUSTED_ORIGINS=self.url,
            PYTHONUNBUFFERED="1",
        )
        self.model_id, self.model_source = model_id, model_source
        self.process: subprocess.Popen | None = None
        self.api_key = ""

    def manage(self, *argv: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *argv],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"manage.py {argv[0]} failed:\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def start(self, timeout_s: float = 120, setup: str = "") -> None:
        """Migrate, create the demo org and key, add the tiny model (the only one enabled: the
        demo's SmolLM2 would take the node seconds to load) and run `setup` (more Python, with
        Django set up), all in one `manage.py shell` (each manage.py start costs seconds); then
        start `serve` and wait until it answers."""
        script = "\n".join(
            [
                "from django.core.management import call_command",
                "from controlplane.catalog.models import ServedModel",
                "call_command('migrate', verbosity=0)",
                f"call_command('demo', '--url', {self.url!r})",
                f"call_command('addmodel', {self.model_id!r}, '--source', "
                f"{str(self.model_source)!r}, '--context-length', '256', '--input', '0.60', "
                "'--cached-input', '0.10', '--output', '3.00')",
                f"ServedModel.objects.exclude(id={self.model_id!r}).update(enabled=False)",
                setup,
            ]
        )
        prepared = self.manage("shell", "-c", script)
        self.api_key = next(
            line.split()[-1] for line in prepared.splitlines() if line.startswith("API key:")
        )
        log = open(self.data_dir / "serve.log", "w")  # noqa: SIM115 (closed with the process)
        self.process = subprocess.Popen(
            [
                *(sys.executable, "manage.py", "serve", "--port", str(self.port)),
                *("--dtype", "float32", *self.serve_args),
            ],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"serve exited early:\n{self.output()}")
            try:
                urllib.request.urlopen(f"{self.url}/healthz", timeout=2)
                return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"serve not ready in {timeout_s} s:\n{self.output()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def output(self) -> str:
        path = self.data_dir / "serve.log"
        return path.read_text()[-4000:] if path.exists() else ""


@contextmanager
def embedded_server(
    data_dir: Path, model_source: Path, *serve_args: str, setup: str = "", **env: str
) -> Iterator[EmbeddedServer]:
    """An `EmbeddedServer` of the tiny model as `tiny`, with `env` added and `setup` run before it
    starts (`EmbeddedServer.start`); stopped, and waited for, on the way out."""
    running = EmbeddedServer(data_dir, "tiny", model_source, *serve_args)
    running.env.update(env)
    try:
        running.start(setup=setup)  # raises with serve's output if it does not come up
        yield running
    finally:
        running.stop()
