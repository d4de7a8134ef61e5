"""A stream whose client hung up stops waiting for its node, even when the hang-up lands in the
event-loop tick where the node's next message arrives.

On Python 3.11, `asyncio.wait_for` then returns the message and swallows the cancel. Our code
does not use it; redis-py does, around every command it sends (controlplane/layer_receive.py).
`WaitForLayer` is channels' in-memory layer (embedded mode's) read through `wait_for` the way
redis-py reads, so the swallowed cancel happens here every time instead of now and then.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from channels.layers import InMemoryChannelLayer

from controlplane import layer_receive
from controlplane.gateway.completions import _receive
from controlplane.jobs.models import Job


class WaitForLayer(InMemoryChannelLayer):
    async def receive(self, channel):
        return await asyncio.wait_for(super().receive(channel), timeout=30)


async def cancel_as_a_message_arrives(layer, receive) -> dict:
    channel = await layer.new_channel()
    waiting = asyncio.create_task(receive(layer, channel))
    # The layer keeps a queue for a channel from the moment a receive waits on it.
    deadline = asyncio.get_running_loop().time() + 5
    while channel not in layer.channels:
        assert asyncio.get_running_loop().time() < deadline, "the receive never waited"
        await asyncio.sleep(0)
    await layer.send(channel, {"type": "delta", "text": "x"})
    waiting.cancel()  # the view's cancel, in the same tick
    return await waiting


def stream_receive(layer, channel):
    # The message arrives, so the job is never read (the quiet path reads its row).
    return _receive(layer, channel, time.monotonic() + 30, Job())


def plain_receive(layer, channel):
    return layer_receive.receive(layer, channel, 30)


@pytest.mark.parametrize("layer", [InMemoryChannelLayer, WaitForLayer])
@pytest.mark.parametrize("receive", [plain_receive, stream_receive])
def test_a_cancel_in_the_tick_of_the_next_message_is_not_lost(layer, receive):
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancel_as_a_message_arrives(layer(), receive))


def test_the_layer_below_does_swallow_that_cancel():
    """The premise: without layer_receive, the cancel is lost and the message returned."""

    async def bare(layer, channel):
        return await layer.receive(channel)

    assert asyncio.run(cancel_as_a_message_arrives(WaitForLayer(), bare))["text"] == "x"


async def receive_what_is_sent(layer) -> dict:
    channel = await layer.new_channel()
    await layer.send(channel, {"type": "delta", "text": "x"})
    return await layer_receive.receive(layer, channel, 30)


def test_without_a_cancel_the_message_is_received():
    assert asyncio.run(receive_what_is_sent(WaitForLayer())) == {"type": "delta", "text": "x"}


def test_a_quiet_channel_times_out():
    async def quiet():
        layer = InMemoryChannelLayer()
        return await layer_receive.receive(layer, await layer.new_channel(), 0.05)

    with pytest.raises(TimeoutError):
        asyncio.run(quiet())
