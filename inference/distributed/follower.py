"""A follower rank (1..N-1) of a group: build this rank's runner, then run the steps rank 0
sends until it says stop.

The process is started by rank 0 (inference/distributed/group.py) with the spawn context. It
joins the group through rank 0's store, builds its `ModelRunner` (its share of the weights, a KV
cache of the block count rank 0 decided), says ready (or sends its error) on a pipe, and then
only executes: it never schedules, samples or holds a request (and answers rank 0's calls:
step_broadcast.py). It exits when rank 0 says stop,
when a collective fails (a rank died), and when rank 0's process is gone, whatever it is
blocked on: no follower outlives its engine. It ignores SIGINT (rank 0's to act on); SIGTERM
ends it, which fails the group (rank 0's exit terminates it that way, being daemonic).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from inference.distributed.step_broadcast import receive_step
from inference.engine.config import EngineConfig
from inference.engine.model_runner import ModelRunner
from inference.models.model_config import ModelConfig

# What a follower reports to rank 0 on its pipe; anything else is the error that stopped it.
STARTED, READY = "started", "ready"
# A follower waits for rank 0's next step however long the engine idles.
_IDLE_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class FollowerSpec:
    """What a follower needs to build its runner and join rank 0's group."""

    config: EngineConfig
    model_config: ModelConfig
    directory: Path
    num_blocks: int
    max_model_len: int
    rank: int
    store_port: int
    num_threads: int  # torch's intra-op threads on the CPU (0: leave torch's default)


def run_follower(spec: FollowerSpec, report: multiprocessing.connection.Connection) -> None:
    """The follower's process: say it started, join the group, build its runner, say ready (or
    send the error that stopped it) on `report`, then follow until stop."""
    _exit_with_parent()
    # Ctrl-C in a terminal reaches the whole process group: rank 0 decides what it means (a
    # node drains), and stops its followers when it is done.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    report.send(STARTED)
    config = spec.config
    world = config.tensor_parallel
    try:
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        timeout = timedelta(seconds=config.distributed_timeout_s)
        store = dist.TCPStore("127.0.0.1", spec.store_port, world, False, timeout)
        dist.init_process_group(
            config.backend, store=store, rank=spec.rank, world_size=world, timeout=timeout
        )
        control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        runner = ModelRunner(
            config,
            spec.model_config,
            spec.directory,
            spec.num_blocks,
            spec.max_model_len,
            config.parallel(spec.rank),
        )
    except BaseException:
        report.send(traceback.format_exc())
        raise
    report.send(READY)
    report.close()
    while (step := receive_step(control, runner)) is not None:
        runner.execute(step)
    dist.destroy_process_group()


def _exit_with_parent() -> None:
    """Exit at once when rank 0's process ends, even while blocked in a collective or a load
    (a SIGKILLed parent runs no cleanup of its own)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
