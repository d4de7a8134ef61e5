"""Token deltas and events to a Channels layer from sync code, never making it wait.

Apart from the node (inference/node/node.py) so that the control plane's processes, which push
events with it, do not import the engine (torch, transformers) for it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)


class DeltaPublisher:
    """Sends token deltas to reply channels on a Channels layer from the node's sync loop.

    The layer's API is async; a private event loop in a daemon thread runs the sends, unless
    `loop` names one that already runs (embedded mode: the in-memory layer's queues belong to the
    server's loop). Deltas are best-effort (the result also travels in `record_completion`), so
    the node never waits on them.
    """

    def __init__(self, channel_layer, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.channel_layer = channel_layer
        self._tails: dict[str, asyncio.Task] = {}
        self.owns_loop = loop is None
        self.loop = loop or asyncio.new_event_loop()
        self.thread = None
        if self.owns_loop:
            self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self.thread.start()

    def send(self, channel: str, message: dict[str, Any]) -> None:
        """Queue `message` for `channel`; messages to one channel arrive in the order sent."""
        self._schedule(channel, lambda: self.channel_layer.send(channel, message))

    def group_send(self, group: str, message: dict[str, Any]) -> None:
        """Queue `message` for every channel of `group`, in order with the group's others."""
        self._schedule(f"group:{group}", lambda: self.channel_layer.group_send(group, message))

    def _schedule(self, key: str, make_send) -> None:
        future = asyncio.run_coroutine_threadsafe(self._in_order(key, make_send), self.loop)
        future.add_done_callback(_log_failed_send)

    async def _in_order(self, key: str, make_send) -> None:
        # Each send is a task of its own, and a Redis send awaits several round trips, so two
        # sends to one channel could overtake each other: each waits for the one before it.
        # Tasks start in the order `_schedule` made them, so the chain follows that order.
        previous = self._tails.get(key)
        current = asyncio.current_task()
        self._tails[key] = current
        try:
            if previous is not None:
                await asyncio.wait([previous])
            await make_send()
        finally:
            if self._tails.get(key) is current:
                del self._tails[key]

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver what is still in flight (up to `timeout_s`), then stop the loop."""
        if not self.owns_loop:
            return  # the loop's owner drains it
        drain = asyncio.run_coroutine_threadsafe(self._drain(), self.loop)
        try:
            drain.result(timeout=timeout_s)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=timeout_s)

    async def _drain(self) -> None:
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        await asyncio.gather(*pending, return_exceptions=True)


def _log_failed_send(future) -> None:
    if future.exception() is not None:
        logger.warning("delta not delivered: %r", future.exception())
