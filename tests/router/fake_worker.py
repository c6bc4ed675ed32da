"""A stand-in worker for the router's security tests: a real HTTP server on 127.0.0.1 that records what the
router sends it (path and Authorization header) and answers with what the test chose.

It is what an attacker would register or a broken worker would be: it needs no model, so tests of the
router's own rules (credentials, rendering of worker data) run in seconds.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional


class FakeWorker:
    """127.0.0.1:<port>: /health 200, /load 200 {}, /dashboard/data `dashboard_data`, POST anything 200 JSON.

    `freeze()` makes it behave like a worker whose scheduler stopped while its HTTP front end runs on:
    /health still answers, /load waits, and a POST gets the status line of an event stream and then
    nothing, until `thaw()`.
    """

    def __init__(self, dashboard_data: Optional[dict] = None):
        self.dashboard_data = dashboard_data or {}
        self.seen: list[tuple[str, str, Optional[str]]] = []     # (method, path, Authorization header)
        self.awake = threading.Event()
        self.awake.set()
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                worker.seen.append(("GET", self.path, self.headers.get("Authorization")))
                path = self.path.split("?")[0]
                if path == "/health":
                    self._answer(200, {})
                elif path == "/load":
                    worker.awake.wait()
                    self._answer(200, {})
                elif path == "/dashboard/data":
                    self._answer(200, worker.dashboard_data)
                else:
                    self._answer(404, {"error": {"message": "not here"}})

            def do_POST(self) -> None:
                worker.seen.append(("POST", self.path, self.headers.get("Authorization")))
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if worker.awake.is_set():
                    self._answer(200, {"text": "from the fake worker", "meta_info": {}})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.flush()
                worker.awake.wait()
                self.close_connection = True

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """Base URL."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def freeze(self) -> None:
        """Stop answering (see the class docstring)."""
        self.awake.clear()

    def thaw(self) -> None:
        """Answer again; what waited is answered (a frozen POST's stream just ends)."""
        self.awake.set()

    def credentials(self) -> set[Optional[str]]:
        """Every Authorization header value it received (None: a request without one)."""
        return {auth for _, _, auth in list(self.seen)}

    def __enter__(self) -> FakeWorker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thaw()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
