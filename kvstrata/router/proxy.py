"""Forwarding requests to workers: choose, send, retry once before the first byte, stream through.

    client ──► route() ──► policy picks w ──► POST w ─┬─ connection error / 5xx before any byte:
                                                      │     w.errors += 1, retry once on another worker
                                                      ├─ w silent for --worker-first-byte-timeout-secs
                                                      │     before any byte: w is stalled (out), retry
                                                      ├─ event stream: nothing goes to the client until
                                                      │     its first chunk; then chunks as they arrive;
                                                      │     a break mid-stream ends with an error event
                                                      └─ other answers (4xx included): passed on unchanged

Nothing is validated here; the worker answers malformed requests itself. A refused connection takes the
worker out at once; the monitor's health checks put it back. A stalled worker comes back as soon as it
sends anything (a /load report included). A worker gets only its own API key, never the client's
credentials.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Optional

import aiohttp
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvstrata.router.access import worker_name
from kvstrata.router.args import RouterArgs
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.policies import Decision, Policy
from kvstrata.router.request_key import route_key, session_id
from kvstrata.router.workers import Worker, WorkerRegistry
from kvstrata.serving.errors import ApiError
from kvstrata.web.sse import SSE_DONE, SSEResponse, sse_event

logger = logging.getLogger(__name__)

# Not forwarded in either direction (hop-by-hop, or recomputed by the sending side).
SKIP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te",
                          "trailer", "upgrade", "proxy-authorization", "proxy-connection", "date", "server"})
# Not forwarded to a worker: the client's credentials are the router's business (a worker gets its own key).
CLIENT_CREDENTIALS = frozenset({"authorization", "cookie", "x-api-key"})
WORKER_HEADER = "x-kvstrata-worker"     # added to proxied answers: which worker served it
CONNECT_TIMEOUT_S = 5.0
ATTEMPTS = 2              # the first try and one retry on another worker
# A worker failure worth another worker (connect timeouts are ClientConnectionErrors); the overall
# --request-timeout-secs is not: it is answered 504 before the stream, or ends the stream.
FAILURES = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
STREAM_FAILURES = (*FAILURES, asyncio.TimeoutError)


class _RetryableFailure(Exception):
    """The attempt failed before any byte reached the client."""


class _Silent(Exception):
    """The worker sent nothing for --worker-first-byte-timeout-secs while the attempt waited on it."""


class Proxy:
    """Sends client requests to workers (HTTP/1.1 keep-alive pool) and relays the answers."""

    def __init__(self, args: RouterArgs, workers: WorkerRegistry, policy: Policy, metrics: RouterMetrics):
        self.args = args
        self.workers = workers
        self.policy = policy
        self.metrics = metrics
        self.session: Optional[aiohttp.ClientSession] = None
        self.active = 0
        self._background: set[asyncio.Task] = set()      # prefetch hints in flight
        self.on_worker_failure: Callable[[Worker], None] = lambda w: None   # the monitor re-checks it

    async def start(self) -> None:
        """Open the connection pool (inside the event loop)."""
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)

    async def close(self) -> None:
        """Close the connection pool."""
        if self.session is not None:
            await self.session.close()

    @staticmethod
    def worker_headers(w: Worker, request_headers: Optional[dict] = None) -> dict:
        """Headers for a request to `w`: the client's minus hop-by-hop ones and credentials, plus w's key."""
        out = {k: v for k, v in (request_headers or {}).items()
               if k.lower() not in SKIP_HEADERS and k.lower() not in CLIENT_CREDENTIALS}
        if w.api_key:
            out["authorization"] = f"Bearer {w.api_key}"
        return out

    # ------------------------------------------------------------------ one request to one worker
    async def route(self, request: Request, affinity: bool = True, reveal: bool = False) -> Response:
        """Forward `request` to one worker (chosen by the policy when `affinity`, else the least loaded);
        workers are named by URL in the answer only when `reveal`."""
        limit = self.args.max_concurrent_requests
        if limit > 0 and self.active >= limit:
            return error_response(f"the router is at --max-concurrent-requests ({limit})", 429)
        self.active += 1
        response: Optional[Response] = None
        try:
            body = await request.body()
            key = route_key(request.url.path, body) if affinity else None
            session = session_id(request.headers, body) if affinity else None
            response = await self._forward(request, body, key, affinity, reveal, session)
            return response
        finally:
            if isinstance(response, RelayResponse):
                response.closers.append(self._release_slot)   # a stream holds its slot until it ends
            else:
                self._release_slot()

    def _release_slot(self) -> None:
        self.active -= 1

    async def _forward(self, request: Request, body: bytes, key, affinity: bool, reveal: bool,
                       session: Optional[str] = None) -> Response:
        tried: list[Worker] = []
        last_error = "no healthy worker"
        for attempt in range(ATTEMPTS):
            candidates = [w for w in self.workers.routable() if w not in tried]
            if not candidates:
                break
            if tried:
                self.metrics.retries.labels(tried[-1].url).inc()
            decision = self.policy.select(candidates, key, session) if affinity else _least_loaded(candidates)
            if decision.warm_tokens:
                self._warm(decision.worker, list(key[:decision.warm_tokens]))
            final = attempt == ATTEMPTS - 1 or len(candidates) == 1
            try:
                return await self._attempt(request, body, key, decision, pass_5xx=final, reveal=reveal)
            except _RetryableFailure as e:
                last_error = str(e)
                tried.append(decision.worker)
        status = 503 if not tried else 502
        return error_response(f"no worker could serve the request: {last_error}", status)

    async def _attempt(self, request: Request, body: bytes, key, decision: Decision, pass_5xx: bool,
                       reveal: bool) -> Response:
        """One try on one worker; raises _RetryableFailure when nothing reached the client (a 5xx is
        passed on unchanged when `pass_5xx`: there is no other worker left to try)."""
        w = decision.worker
        name = worker_name(w.url, w.id, reveal)
        units = self.policy.prefill_units(w, key, decision)
        self.policy.record(w, key)
        self.metrics.decisions.labels(w.url, decision.reason).inc()
        if decision.best_cached_tokens is not None and decision.best_cached_tokens > (decision.cached_tokens or 0):
            self.metrics.off_best.labels(decision.reason).inc()
            self.metrics.forgone_hits.labels(decision.reason).inc(decision.best_cached_tokens - (decision.cached_tokens or 0))
        self.metrics.requests.labels(w.url).inc()
        w.begin(units)
        got_first_byte = streaming = False
        upstream: Optional[aiohttp.ClientResponse] = None
        try:
            upstream = await self._unless_silent(w, self._send(w, request, body))
            w.first_byte(units)
            got_first_byte = True
            is_stream = upstream.content_type == "text/event-stream"
            # A stream's status line comes before its first token, even from a stuck scheduler: only its
            # first event shows the worker alive, and until then the request can still go elsewhere.
            first = await self._unless_silent(w, upstream.content.readany()) \
                if is_stream and upstream.status < 500 else b""
            w.progress()
            if upstream.status >= 500:
                self.metrics.errors.labels(w.url).inc()
                if not pass_5xx:
                    text = await upstream.text(errors="replace")
                    upstream.release()
                    raise _RetryableFailure(f"{name} answered {upstream.status}: {text[:200]}")
            if is_stream:
                streaming = True
                return RelayResponse(self._relay(w, upstream, first, name), upstream.status,
                                     response_headers(upstream, name),
                                     closers=[upstream.close, lambda: w.end(units, got_first_byte=True)])
            data = await upstream.read()
            return Response(data, status_code=upstream.status, headers=response_headers(upstream, name))
        except FAILURES as e:
            self._taken_out(w, e)
            raise _RetryableFailure(f"{name}: {type(e).__name__}") from None
        except _Silent:
            self.metrics.errors.labels(w.url).inc()
            raise _RetryableFailure(f"{name} sent nothing for --worker-first-byte-timeout-secs "
                                    f"({self.args.worker_first_byte_timeout_secs:g} s)") from None
        except asyncio.TimeoutError:
            self.metrics.errors.labels(w.url).inc()
            return error_response(f"{name} did not answer within --request-timeout-secs "
                                  f"({self.args.request_timeout_secs:g} s)", 504)
        finally:
            if not streaming:
                w.end(units, got_first_byte)
                if upstream is not None:
                    upstream.close()      # a no-op once its body was read (the connection is back in the pool)

    async def _unless_silent(self, w: Worker, work: Awaitable):
        """Await `work` (a step of a request to `w` before its first byte); raise _Silent, cancelling it,
        if `w` sends nothing at all for --worker-first-byte-timeout-secs meanwhile. Bytes of its other
        requests and its /load reports count, so a busy worker with long answers is not silent."""
        bound = self.args.worker_first_byte_timeout_secs
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait([task], timeout=max(0.0, bound - w.silent_for()))
                if done:
                    return task.result()
                if w.silent_for() >= bound:
                    mark_stalled(w, bound)
                    raise _Silent()
        finally:
            if not task.done():
                task.cancel()     # closes the connection: the worker aborts the request when it wakes

    async def _send(self, w: Worker, request: Request, body: bytes) -> aiohttp.ClientResponse:
        assert self.session is not None
        url = w.url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        timeout = aiohttp.ClientTimeout(total=self.args.request_timeout_secs, sock_connect=CONNECT_TIMEOUT_S)
        return await self.session.request(request.method, url, data=body, timeout=timeout,
                                          headers=self.worker_headers(w, dict(request.headers)))

    async def _relay(self, w: Worker, upstream: aiohttp.ClientResponse, first: bytes,
                     name: str) -> AsyncIterator[bytes]:
        """The worker's event stream (`first` is its first chunk), chunk by chunk as it arrives; an error
        event if it breaks."""
        at_event_end = not first or first.endswith(b"\n\n")
        yield first
        try:
            async for chunk in upstream.content.iter_any():
                w.progress()
                at_event_end = chunk.endswith(b"\n\n")
                yield chunk
        except STREAM_FAILURES as e:
            self.metrics.errors.labels(w.url).inc()
            self.on_worker_failure(w)
            logger.warning("stream from %s broke: %s: %s", w.url, type(e).__name__, e)
            message = f"the worker {name} failed mid-stream: {type(e).__name__}"
            yield (b"" if at_event_end else b"\n\n") + stream_error(message)

    def _warm(self, w: Worker, input_ids: list[int]) -> None:
        """Tell `w` (fire and forget) to start loading this prefix from its L2/L3 while the request travels."""
        headers = self.worker_headers(w)
        if self.args.worker_admin_api_key:
            headers["authorization"] = f"Bearer {self.args.worker_admin_api_key}"
        self.metrics.prefetch_hints.labels(w.url).inc()

        async def send() -> None:
            assert self.session is not None
            try:
                async with self.session.post(w.url + "/prefetch", json={"input_ids": input_ids}, headers=headers,
                                             timeout=aiohttp.ClientTimeout(total=5.0)) as resp:
                    await resp.read()
                    if resp.status != 202:
                        logger.debug("prefetch hint to %s: %s", w.url, resp.status)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                logger.debug("prefetch hint to %s failed: %s", w.url, e)

        self._background.add(task := asyncio.ensure_future(send()))
        task.add_done_callback(self._background.discard)

    def _taken_out(self, w: Worker, err: BaseException) -> None:
        self.metrics.errors.labels(w.url).inc()
        if isinstance(err, aiohttp.ClientConnectorError):   # refused: it is down (a dropped keep-alive is not)
            mark_down(w, err)
        else:
            self.on_worker_failure(w)

    # ------------------------------------------------------------------ every worker
    async def broadcast(self, request: Request) -> Response:
        """Send `request` to every healthy worker; 200 if all agree, else the first failure unchanged."""
        body = await request.body()
        targets = [w for w in self.workers.all() if w.healthy]
        if not targets:
            return error_response("no healthy worker", 503)
        results = await asyncio.gather(*(self._send_and_read(w, request, body) for w in targets))
        for status, headers, data in results:
            if status != 200:
                return Response(data, status_code=status, headers=headers)
        return JSONResponse({"success": True, "workers": [w.url for w in targets]})

    async def _send_and_read(self, w: Worker, request: Request, body: bytes) -> tuple[int, dict, bytes]:
        try:
            async with await self._send(w, request, body) as upstream:
                return upstream.status, response_headers(upstream), await upstream.read()
        except STREAM_FAILURES as e:
            err = ApiError(f"{w.url}: {type(e).__name__}: {e}", 502)
            return 502, {"content-type": "application/json"}, JSONResponse(err.to_dict()).body


class RelayResponse(SSEResponse):
    """A relayed event stream with the worker's status and headers.

    SSEResponse's handling of a client that leaves (stop, close the generator) is what a relay needs;
    `closers` run once when the response is over, however it ended, even if the stream never started.
    """

    def __init__(self, content: AsyncIterator[bytes], status: int, headers: dict,
                 closers: list[Callable[[], None]]):
        StreamingResponse.__init__(self, content, status_code=status, headers=headers)   # not SSEResponse's
        self.closers = closers
        self.on_close = self._close

    def _close(self) -> None:
        for close in self.closers:
            close()


def mark_down(w: Worker, reason: object) -> None:
    """Take `w` out at once (its port refuses connections); health checks put it back."""
    if w.healthy:
        logger.warning("taking %s out: %s", w.url, reason)
    w.healthy = False
    w.success_streak = 0


def mark_stalled(w: Worker, bound_s: float) -> None:
    """Take `w` out until it sends anything again: it holds requests and has been silent for `bound_s`."""
    if not w.stalled:
        logger.warning("taking %s out: %d requests in flight and nothing from it for %.1f s",
                       w.url, w.in_flight, bound_s)
    w.stalled = True


def _least_loaded(workers: list[Worker]) -> Decision:
    return Decision(min(workers, key=lambda w: w.in_flight), "least_loaded")


def response_headers(upstream: aiohttp.ClientResponse, worker_name: Optional[str] = None) -> dict:
    """The worker's response headers minus hop-by-hop ones, plus which worker answered (by URL or id)."""
    out = {k: v for k, v in upstream.headers.items() if k.lower() not in SKIP_HEADERS}
    if worker_name is not None:
        out[WORKER_HEADER] = worker_name
    return out


def error_response(message: str, status: int) -> JSONResponse:
    """A router-made error in the worker's error shape."""
    return JSONResponse(ApiError(message, status).to_dict(), status_code=status)


def stream_error(message: str) -> bytes:
    """The error event and [DONE] that end a broken stream, as a worker ends a failed one."""
    return (sse_event(ApiError(message, 502).to_dict()) + SSE_DONE).encode()
