"""A call every rank of a group runs on its own runner, outside a step.

Steps are the hot path and travel as integers (step_broadcast.py); a call is the rare exception:
something each rank must do with what only it holds, its share of the weights or of the KV cache
(disaggregation's KV transfer: open the rank's Transfer Engine over its cache, write its blocks to
a peer). Rank 0 sends a picklable callable, every rank runs it at once, rank 0 gathers the
results. A call that raises on a rank comes back as `CallFailed`, so that the ranks stay in step
and rank 0 decides what the failure means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from inference.engine.model_runner import ModelRunner


class RankCall(Protocol):
    """What every rank runs on its own runner (picklable: followers are other processes)."""

    def __call__(self, runner: ModelRunner) -> Any: ...


@dataclass(frozen=True)
class CallFailed:
    """A rank's call raised: which rank, and the error."""

    rank: int
    error: str


def attempt(call: RankCall, runner: ModelRunner) -> Any:
    """`call(runner)`, or CallFailed with the error it raised."""
    try:
        return call(runner)
    except Exception as error:
        return CallFailed(runner.parallel.rank, f"{type(error).__name__}: {error}")
