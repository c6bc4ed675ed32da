"""The control channel of a running `kvstrata cluster up`: a Unix socket in its run directory.

A client sends one `ControlRequest` as a JSON line; the supervisor answers with `ControlReply` lines:
progress lines (`done: false`) and one final line (`done: true`, `ok` says whether it worked).
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

OPS = ("status", "upgrade", "restart", "down")


@dataclass(frozen=True)
class ControlRequest:
    """What a CLI asks the supervisor: an op, the role it acts on, `--set` settings, flags."""

    op: str
    role: Optional[str] = None
    settings: dict[str, Any] = field(default_factory=dict)
    drain: bool = True


@dataclass(frozen=True)
class ControlReply:
    """One line of the answer."""

    done: bool
    ok: bool = True
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)


Progress = Callable[[str], None]
Handler = Callable[[ControlRequest, Progress], ControlReply]


class ControlServer:
    """Serves requests on `path`, one thread per connection, until `close()`."""

    def __init__(self, path: str, handler: Handler):
        self.path = path
        self.handler = handler
        if os.path.exists(path):
            os.unlink(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.active: set[threading.Thread] = set()
        self.thread = threading.Thread(target=self._accept, name="cluster-control", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return          # closed
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.active.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rw", encoding="utf-8") as fh:
            def send(reply: ControlReply) -> None:
                fh.write(json.dumps(asdict(reply)) + "\n")
                fh.flush()

            try:
                request = ControlRequest(**json.loads(fh.readline()))
                if request.op not in OPS:
                    raise ValueError(f"unknown op {request.op!r}; ops: {', '.join(OPS)}")
                reply = self.handler(request, lambda msg: send(ControlReply(done=False, message=msg)))
            except Exception as e:   # a bad request or a failed op is answered, never kills the server
                reply = ControlReply(done=True, ok=False, message=f"{type(e).__name__}: {e}")
            try:
                send(reply)
            except OSError:
                pass                 # the client went away
        self.active.discard(threading.current_thread())

    def close(self, wait_s: float = 5.0) -> None:
        """Stop accepting, let answers under way finish (up to `wait_s`), remove the socket file."""
        self.sock.close()
        for thread in list(self.active):
            if thread is not threading.current_thread():
                thread.join(wait_s)
        if os.path.exists(self.path):
            os.unlink(self.path)


def request(path: str, req: ControlRequest, timeout_s: float = 3600.0) -> Iterator[ControlReply]:
    """Send `req` to the supervisor at `path` and yield its reply lines (the last has done=True)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(path)
        with sock.makefile("rw", encoding="utf-8") as fh:
            fh.write(json.dumps(asdict(req)) + "\n")
            fh.flush()
            for line in fh:
                reply = ControlReply(**json.loads(line))
                yield reply
                if reply.done:
                    return
    raise ConnectionError("the supervisor closed the connection before answering")


def call(path: str, req: ControlRequest, progress: Optional[Progress] = None,
         timeout_s: float = 3600.0) -> ControlReply:
    """Send `req` and return the final reply, passing progress lines to `progress`."""
    for reply in request(path, req, timeout_s):
        if reply.done:
            return reply
        if progress:
            progress(reply.message)
    raise ConnectionError("no final reply")
