"""Hearth's production mode as real processes: uvicorn (the gateway), `manage.py runnode` (one
or more nodes) and `manage.py rundramatiq` (the control plane's worker), against PostgreSQL and
Redis. Used by the multi-process tests and by bench/gateway.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProductionStack:
    """Start with `start()`, stop with `stop()`; `output()` returns each process's log."""

    def __init__(self, database_url: str, redis_url: str, namespace: str, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
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
        }
        self.processes: dict[str, subprocess.Popen] = {}

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        process = subprocess.Popen(
            argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, text=True
        )
        self.processes[name] = process
        return process

    def start_gateway(self) -> None:
        self._spawn(
            "gateway",
            [
                sys.executable,
                "-m",
                "uvicorn",
                "controlplane.asgi:application",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
            ],
        )

    def start_worker(self) -> None:
        self._spawn(
            "worker",
            [
                sys.executable,
                "manage.py",
                "rundramatiq",
                "--queues",
                "default",
                "--processes",
                "1",
                "--threads",
                "4",
            ],
        )

    def start_node(self, model: str, node_id: str, *extra: str) -> None:
        self._spawn(
            f"node-{node_id}",
            [
                sys.executable,
                "manage.py",
                "runnode",
                "--model",
                model,
                "--node-id",
                node_id,
                "--dtype",
                "float32",
                "--kv-cache-mb",
                "16",
                *extra,
            ],
        )

    def wait_ready(self, model: str, nodes: int, api_key: str, timeout_s: float = 120) -> None:
        """Until the gateway answers and `nodes` nodes of `model` heartbeat."""
        import redis

        from inference.node.heartbeat import NODE_KEY_PREFIX

        client = redis.Redis.from_url(self.env["REDIS_URL"])
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
        path = self.log_dir / f"{name}.log"
        return path.read_text()[-4000:] if path.exists() else ""

    def outputs(self) -> str:
        return "\n".join(f"--- {name}\n{self.output(name)}" for name in self.processes)
