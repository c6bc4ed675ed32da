"""A recording TCP relay for tests: put it between the router and a worker to see the worker's exact bytes.

It is not a stand-in for anything: it copies bytes both ways unchanged and keeps what the worker sent,
so a test can compare the router's output with the worker's output for the very same request.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Optional


class TcpTap:
    """127.0.0.1:<port> → target; `responses()` parses what the target sent back (HTTP/1.1)."""

    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.connections: list[bytearray] = []     # what the target sent, per connection
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: Optional[asyncio.AbstractServer] = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TcpTap:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        """Base URL of the relay."""
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._relay, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(*self.target)
        received = bytearray()
        self.connections.append(received)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, record: bool) -> None:
            try:
                while data := await src.read(65536):
                    if record:
                        received.extend(data)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(client_r, up_w, False), pipe(up_r, client_w, True))

    def responses(self) -> list[tuple[bytes, dict[str, str], bytes]]:
        """(status line, headers, de-chunked body) of every complete response seen, per connection in order."""
        return [r for received in list(self.connections) for r in _parse(bytes(received))]


def _parse(data: bytes) -> list[tuple[bytes, dict[str, str], bytes]]:
    """Split one connection's bytes into responses (HTTP/1.1, content-length or chunked)."""
    out = []
    while b"\r\n\r\n" in data:
        head, data = data.split(b"\r\n\r\n", 1)
        status, *lines = head.split(b"\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (ln.decode().split(":", 1) for ln in lines)}
        if headers.get("transfer-encoding") == "chunked":
            body = bytearray()
            while True:
                if b"\r\n" not in data:
                    return out                # still arriving
                size_line, data = data.split(b"\r\n", 1)
                size = int(size_line.split(b";")[0], 16)
                body += data[:size]
                data = data[size + 2:]
                if size == 0:
                    break
            out.append((status, headers, bytes(body)))
        else:
            n = int(headers.get("content-length", 0))
            out.append((status, headers, data[:n]))
            data = data[n:]
    return out
