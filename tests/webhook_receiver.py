"""A customer's webhook receiver, for the tests: a real HTTP server on 127.0.0.1 that records
every POST and answers as scripted."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standardwebhooks.webhooks import Webhook


class Receiver:
    """An HTTP server on 127.0.0.1 that records each POST and answers as `script` says: one
    `(delay_s, status)` per request, in order, then 200 at once."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.script: list[tuple[float, int]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with receiver.lock:
                    receiver.requests.append(
                        ({k.lower(): v for k, v in self.headers.items()}, body)
                    )
                    delay_s, status = receiver.script.pop(0) if receiver.script else (0.0, 200)
                time.sleep(delay_s)
                try:
                    self.send_response(status)
                    self.end_headers()
                    self.wfile.write(b"thanks")
                except OSError:
                    pass  # the sender timed out and hung up

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hooks?source=hearth"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def verified(self, secret: str) -> list[dict]:
        """Every request received so far, its signature checked with the `standardwebhooks`
        package as a customer's server would (raises on a bad one); the bodies, in order."""
        with self.lock:
            received = list(self.requests)
        return [Webhook(secret).verify(body, headers) for headers, body in received]
