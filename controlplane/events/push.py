"""Pushing events to an org's live listeners (the console's WebSockets) over the channel layer.

Pushes come from sync code (the gateway's admission thread, the worker's actors) and must not
make it wait: a push is scheduled on an event loop and the caller moves on. In production that
is a private loop in a daemon thread, started on first use (`async_to_sync` would build a loop
per call). The in-memory layer of embedded mode keeps asyncio queues that
belong to the server's event loop, so there a push must run on that loop: the embedded server
registers it with `bind_loop`.
"""

from __future__ import annotations

import asyncio
import threading

from channels.layers import get_channel_layer

from inference.protocol.delta_publisher import DeltaPublisher

_server_loop: asyncio.AbstractEventLoop | None = None
_publisher: DeltaPublisher | None = None
_lock = threading.Lock()


def bind_loop(loop: asyncio.AbstractEventLoop | None) -> None:
    """Run every push on `loop` (embedded mode's in-memory channel layer); None unbinds."""
    global _server_loop, _publisher
    with _lock:
        _server_loop, _publisher = loop, None


def _get_publisher() -> DeltaPublisher | None:
    global _publisher
    with _lock:
        if _publisher is None:
            layer = get_channel_layer()
            if layer is None:
                return None
            # Without a server loop the publisher runs one of its own in a daemon thread. It
            # keeps each group's pushes in order: job.running never overtakes job.queued.
            _publisher = DeltaPublisher(layer, loop=_server_loop)
        return _publisher


def org_group(org_id: int) -> str:
    """The channel-layer group of one org's listeners."""
    return f"org.{org_id}"


def push_to_org(org_id: int, types: list[str], sequence: int | None = None) -> None:
    """Best effort: the events are already committed, so a lost push loses nothing.

    One push announces everything a transaction wrote for the org: the `types` of its events
    (a stream filtered by type wakes only for its own) and the highest `sequence` (not part of
    any client-visible event), which lets a listener that has already read past it skip the
    push. Listeners read the events themselves from the log."""
    publisher = _get_publisher()
    if publisher is not None:
        message = {"type": "event.message", "types": types, "sequence": sequence}
        publisher.group_send(org_group(org_id), message)
