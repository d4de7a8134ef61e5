"""The API's ASGI handler (controlplane/asgi.py): an async view's response is closed on the event
loop, not by a hop to the sync thread, and the view still answers as Django would."""

from __future__ import annotations

import json
import threading

import pytest
from asgiref.sync import async_to_sync
from asgiref.testing import ApplicationCommunicator
from django.core import signals

# The admission pool's threads may hold a connection from an earlier test, which a refusal
# checks on its way out (close_old_connections).
pytestmark = pytest.mark.django_db


def request(
    method: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]]
) -> tuple[int, dict, str]:
    """`method` `body` to `path` through the ASGI application: (status, error object, the name of
    the thread that closed the response)."""
    from controlplane.asgi import ApiHandler, application

    closed_on: list[str] = []

    def on_finished(sender, **kwargs) -> None:
        closed_on.append(threading.current_thread().name)

    signals.request_finished.connect(on_finished, sender=ApiHandler)
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1:8000"), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }

    async def exchange() -> tuple[int, dict, str]:
        client = ApplicationCommunicator(application, scope)
        await client.send_input({"type": "http.request", "body": body, "more_body": False})
        start = await client.receive_output(10)
        payload = await client.receive_output(10)
        await client.wait(10)
        return start["status"], json.loads(payload["body"])["error"], threading.current_thread()

    try:
        status, error, loop_thread = async_to_sync(exchange)()
    finally:
        signals.request_finished.disconnect(on_finished, sender=ApiHandler)
    assert closed_on, "the response was never closed"
    return status, error, "loop" if closed_on == [loop_thread.name] else closed_on[0]


def test_an_api_response_is_closed_on_the_event_loop():
    status, error, closed_on = request("POST", "/v1/chat/completions", b"{}", [])
    assert (status, error["code"]) == (401, "missing_api_key")
    assert closed_on == "loop"


def test_a_view_that_refuses_the_method_answers_and_is_closed_on_the_loop():
    status, error, closed_on = request("GET", "/v1/completions", b"", [])
    assert (status, error["code"]) == (405, "method_not_allowed")
    assert closed_on == "loop"
