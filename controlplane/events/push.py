"""Pushing events to an org's live listeners (the console's WebSockets) over the channel layer.

Pushes come from sync code: the gateway's admission thread and the worker's actors. In production
`async_to_sync` runs the send on a loop of its own, which the Redis layer is happy with. The
in-memory layer of embedded mode keeps asyncio queues that belong to the server's event loop, so
there a send must run on that loop: the embedded server registers it with `bind_loop`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

logger = logging.getLogger(__name__)
_server_loop: asyncio.AbstractEventLoop | None = None


def bind_loop(loop: asyncio.AbstractEventLoop | None) -> None:
    """Run every push on `loop` (embedded mode's in-memory channel layer); None unbinds."""
    global _server_loop
    _server_loop = loop


def org_group(org_id: int) -> str:
    """The channel-layer group of one org's listeners."""
    return f"org.{org_id}"


def push_to_org(org_id: int, event: dict[str, Any]) -> None:
    """Best effort: the event row is already committed, so a lost push loses nothing."""
    layer = get_channel_layer()
    if layer is None:
        return
    message = {"type": "event.message", "event": event}
    try:
        if _server_loop is not None:
            asyncio.run_coroutine_threadsafe(
                layer.group_send(org_group(org_id), message), _server_loop
            )
        else:
            async_to_sync(layer.group_send)(org_group(org_id), message)
    except Exception:  # a push must never fail the state change it announces
        logger.exception("event push to org %s failed", org_id)
