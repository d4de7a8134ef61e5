"""Rank 0's hold on a group of rank processes serving one model as one engine.

The engine's own process is rank 0: it starts ranks 1..N-1 (`torch.multiprocessing`'s spawn
context), each of which builds its `ModelRunner` over its share of the weights and a KV cache of
the same number of blocks, then follows (inference/distributed/follower.py). Rank 0 decides
every step; before its own forward it sends the flattened step to the followers
(inference/distributed/step_broadcast.py), every rank runs the forward (the model's collectives
pair up), and only rank 0 samples.

Two process groups: the world group (gloo on the CPU, nccl on CUDA) carries the model's
collectives with a finite timeout; a gloo control group carries the steps. A follower waits on
the control group without a timeout (an idle engine sends nothing for hours), while rank 0's
side of it has the finite one (a timeout is a process's own setting), so a follower that stops
taking steps fails the step instead of hanging it.

Faults: a follower that dies closes its connections, so rank 0's pending or next collective
fails at once (gloo); rank 0 also checks the followers' exit codes before each step. Either way
`run` raises `GroupFailure` naming the rank, stops the other followers and leaves the group down:
the engine is finished, and a node exits non-zero so that the broker redelivers its requests. A
follower watches its parent and exits when rank 0 is gone.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from inference.distributed.follower import READY, STARTED, FollowerSpec, run_follower
from inference.distributed.rank_call import RankCall, attempt
from inference.distributed.step_broadcast import gather_results, send_call, send_step, send_stop
from inference.engine.config import EngineConfig
from inference.engine.model_runner import FlatStep, ModelRunner
from inference.models.model_config import ModelConfig

logger = logging.getLogger(__name__)

# How long close() waits for a follower to leave after the stop message before killing it.
_JOIN_S = 10.0


class GroupFailure(RuntimeError):
    """A rank of the group died, or a step's collective failed: the group is down."""


class RankGroup:
    """Starts the followers of a group, sends them each step, and stops them.

    `pids` are the followers' process ids, in rank order.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        directory: Path,
        num_blocks: int,
        max_model_len: int,
    ) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "this process already belongs to a torch.distributed group: one group engine "
                "per process (close the other engine first)"
            )
        world = config.tensor_parallel
        self.failure: str | None = None
        self.ready = self.closed = False
        timeout = timedelta(seconds=config.distributed_timeout_s)
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout, wait_for_workers=False)
        self._threads_before = torch.get_num_threads()
        if config.device == "cpu":
            # The ranks share the machine's cores: without this each would run as many threads
            # as there are cores, and the group would oversubscribe them world-fold.
            torch.set_num_threads(_threads_per_rank(world))
        context = mp.get_context("spawn")
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._reports: list[multiprocessing.connection.Connection] = []
        for rank in range(1, world):
            reader, writer = context.Pipe(duplex=False)
            spec = FollowerSpec(
                config=config,
                model_config=model_config,
                directory=directory,
                num_blocks=num_blocks,
                max_model_len=max_model_len,
                rank=rank,
                store_port=store.port,
                num_threads=_threads_per_rank(world) if config.device == "cpu" else 0,
            )
            process = context.Process(
                target=run_follower, args=(spec, writer), name=f"hearth-rank-{rank}", daemon=True
            )
            process.start()
            writer.close()
            self.processes.append(process)
            self._reports.append(reader)
        try:
            # A follower that cannot even start (a script without a `__main__` guard, which
            # spawn re-runs) would leave the rendezvous below waiting out its timeout.
            self._expect(STARTED)
            dist.init_process_group(
                config.backend, store=store, rank=0, world_size=world, timeout=timeout
            )
            self.control = dist.new_group(backend="gloo", timeout=timeout)
        except BaseException:
            self._kill_followers()
            for reader in self._reports:
                reader.close()
            if dist.is_initialized():
                dist.destroy_process_group()
            torch.set_num_threads(self._threads_before)
            raise

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def wait_ready(self) -> None:
        """Block until every follower has built its runner; raise GroupFailure with a
        follower's error (or its exit code, when it died without a word) if one could not."""
        self._expect(READY)
        self.ready = True

    def run(self, step: FlatStep, execute: Callable[[FlatStep], torch.Tensor | None]):
        """Send `step` to the followers, then `execute` it here; what `execute` returned.
        Any failure on the way takes the group down and raises GroupFailure."""
        self._check_alive()
        try:
            send_step(step, self.control)
            return execute(step)
        except Exception as error:
            # Whatever broke, the ranks are no longer in step with each other.
            self._fail(self._describe(error))
            raise GroupFailure(f"the rank group failed mid-step: {self.failure}") from error

    def call(self, call: RankCall, runner: ModelRunner) -> list:
        """Run `call` on every rank (`runner`: rank 0's), concurrently; the results in rank
        order, a rank's exception as `CallFailed` (rank_call.py). A rank that dies meanwhile
        raises GroupFailure."""
        self._check_alive()
        try:
            send_call(call, self.control)
            return gather_results(attempt(call, runner), len(self.processes) + 1, self.control)
        except Exception as error:
            self._fail(self._describe(error))
            raise GroupFailure(f"the rank group failed in a call: {self.failure}") from error

    def _check_alive(self) -> None:
        if self.failure is None:
            dead = next((rank for rank, p in enumerate(self.processes, 1) if not p.is_alive()), 0)
            if dead:
                self._fail(f"rank {dead} exited with code {self._exitcode(dead)}")
        if self.failure is not None:
            raise GroupFailure(f"the rank group is down: {self.failure}")

    def close(self) -> None:
        """Stop the followers (the stop message, then kill after a grace period; at once when
        they have not all started) and leave the group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.ready and self.failure is None:
            try:
                send_stop(self.control)
            except Exception:  # a follower died meanwhile: it is killed below
                logger.warning("a follower did not take the stop message", exc_info=True)
            for process in self.processes:
                process.join(_JOIN_S)
        self._kill_followers()
        for reader in self._reports:
            reader.close()
        dist.destroy_process_group()
        torch.set_num_threads(self._threads_before)

    def _expect(self, stage: str) -> None:
        """Wait for every follower to report `stage`; GroupFailure when one reports an error
        or dies first."""
        pending = {reader: rank for rank, reader in enumerate(self._reports, 1)}
        while pending:
            for reader in multiprocessing.connection.wait(list(pending)):
                rank = pending.pop(reader)
                try:
                    message = reader.recv()
                except EOFError:  # its end closed: the process is gone
                    message = f"exited with code {self._exitcode(rank)}"
                if message != stage:
                    self._fail(f"rank {rank} could not start: {message}")
                    raise GroupFailure(f"the group could not start: {self.failure}")

    # ---- faults ---------------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        """Record why the group is down and stop every follower (the survivors would wait on
        the dead rank's collectives until they time out)."""
        if self.failure is None:
            self.failure = reason
            logger.error("rank group down: %s", reason)
        self._kill_followers()

    def _describe(self, error: Exception) -> str:
        """Which rank died, if one did (a dead peer's socket closes before its exit code is
        collected: wait a moment for it), else the error itself."""
        for rank, process in enumerate(self.processes, 1):
            process.join(1.0)
            if process.exitcode is not None:
                return f"rank {rank} exited with code {process.exitcode} ({error})"
        return f"{type(error).__name__}: {error}"

    def _exitcode(self, rank: int) -> int | None:
        process = self.processes[rank - 1]
        process.join(1.0)
        return process.exitcode

    def _kill_followers(self) -> None:
        for process in self.processes:
            if process.exitcode is None:
                process.kill()
        for process in self.processes:
            process.join()


def _threads_per_rank(world: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // world)
