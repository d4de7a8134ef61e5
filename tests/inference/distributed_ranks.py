"""Run a function on N real `gloo` ranks, each a separate process, and hand back each rank's
result: the harness for tests of tensor and expert parallelism on the CPU.

`run_ranks(function, world_size, *args)` spawns `world_size` processes (the "spawn" start
method: a fresh interpreter each, as torchrun would give), joins them into one default process
group over TCP on a free loopback port, calls `function(rank, world_size, *args)` in each, and
returns the results in rank order. `function` and `args` must be picklable (a module-level
function of an importable module); results are pickled with the standard pickler, so tensors come
back as copies, never as shared memory of a process that has exited. A rank that raises fails
the call with its traceback; a rank that dies, or a group that outlives `timeout`, fails it too,
and every rank still running is terminated.
"""

from __future__ import annotations

import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank raised, died, or the group did not finish in time."""


def free_port() -> int:
    """A TCP port free on the loopback interface now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(
    function: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads_per_rank: int = 1,
) -> list[Any]:
    """`function(rank, world_size, *args)` on each of `world_size` gloo ranks; the results in
    rank order. `threads_per_rank` bounds each rank's intra-op threads (the ranks share the
    machine's cores)."""
    context = mp.get_context("spawn")
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    processes = [
        context.Process(
            target=_rank_main,
            args=(function, rank, world_size, init_method, threads_per_rank, results, args),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    try:
        return _collect(processes, results, world_size, timeout)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join(timeout=10)


def _collect(processes, results, world_size: int, timeout: float) -> list[Any]:
    outcomes: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < world_size:
        try:
            rank, failed, payload = results.get(timeout=0.5)
        except queue.Empty:
            rank = None
        if rank is None:
            _check_alive(processes, outcomes, results, deadline, timeout)
            continue
        if failed:
            raise RankFailed(f"rank {rank} raised:\n{payload}")
        outcomes[rank] = pickle.loads(payload)
    return [outcomes[rank] for rank in range(world_size)]


def _check_alive(processes, outcomes, results, deadline: float, timeout: float) -> None:
    """Raise when a rank died without a result or the group ran out of time."""
    dead = [
        rank
        for rank, process in enumerate(processes)
        if rank not in outcomes and not process.is_alive()
    ]
    # A rank that put its result and exited may still have it in the queue's pipe.
    if dead and results.empty():
        time.sleep(0.5)
        if results.empty():
            codes = {rank: processes[rank].exitcode for rank in dead}
            raise RankFailed(f"ranks exited without a result (exit codes {codes})")
    if time.monotonic() > deadline:
        missing = sorted(set(range(len(processes))) - set(outcomes))
        raise RankFailed(f"ranks {missing} did not finish within {timeout} s")


def _rank_main(function, rank, world_size, init_method, threads, results, args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
        try:
            payload = pickle.dumps(function(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
        results.put((rank, False, payload))
    except BaseException:
        results.put((rank, True, traceback.format_exc()))
