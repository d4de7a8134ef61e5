"""The next message on a channel layer's channel, within a time limit, for a view whose client
may hang up.

Django cancels an async view's task when its client disconnects, and a stream relies on that
cancel to stop. On Python 3.11, `asyncio.wait_for` returns its awaitable's result instead of
raising when the cancel lands in the tick that awaitable finishes, and redis-py sends every
command under `wait_for` when a socket timeout is set (ours is, for channels_redis's BRPOP): a
cancel that met a Redis command in flight was lost, and the stream ran on to its end for
nobody. The task still counts the cancel (`Task.cancelling`), so it is raised here.
"""

from __future__ import annotations

import asyncio


async def receive(layer, channel: str, timeout_s: float) -> dict:
    """The next message on `channel`; TimeoutError after `timeout_s`; CancelledError once the
    task was cancelled, even where a library below swallowed the cancel."""
    # asyncio.timeout, not wait_for: the same swallowed cancel, one level up.
    async with asyncio.timeout(timeout_s):
        message = await layer.receive(channel)
    raise_if_cancelled()
    return message


def raise_if_cancelled() -> None:
    """Raise the CancelledError of a cancel requested of this task and swallowed below."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
