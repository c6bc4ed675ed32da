"""PD routing (`kvstrata router --pd-disaggregation`): one prefill and one decode server per request.

    client ──► route() ─┬─ prefill policy picks P (cache affinity), decode policy picks D (load)
                        ├─ body + bootstrap_host/port (P's bootstrap service) + a fresh bootstrap_room
                        ├─ POST to P (never streamed: its answer is the first token and prompt logprobs)
                        │  and POST to D (as the client asked), at the same time
                        └─ D's answer goes to the client; for a native non-streamed request that asked
                           for logprobs, P's prompt logprobs are merged into it

The two servers do the handshake themselves (kvstrata/disagg). A client that goes away closes both
connections, so both servers abort the request and free its KV. Flags follow SGLang's router:
`--prefill URL [BOOTSTRAP_PORT]` (repeatable), `--decode URL`, `--prefill-policy`, `--decode-policy`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
from collections.abc import AsyncIterator
from typing import Any, Optional
from urllib.parse import urlsplit

import aiohttp
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvstrata.args import ConfigError
from kvstrata.router.access import worker_name
from kvstrata.router.policies import Policy, make_policy
from kvstrata.router.proxy import FAILURES, Proxy, error_response, response_headers, stream_error
from kvstrata.router.request_key import route_key
from kvstrata.router.workers import Worker, WorkerRegistry

DEFAULT_BOOTSTRAP_PORT = 8998     # a prefill server's --disaggregation-bootstrap-port default
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


# ---------------------------------------------------------------------- CLI
def add_pd_cli_args(parser: argparse.ArgumentParser) -> None:
    """`--prefill URL [BOOTSTRAP_PORT]` and `--decode URL`, each repeatable (SGLang router syntax)."""
    parser.add_argument("--prefill", dest="prefill", action="append", nargs="+", default=[],
                        metavar="URL [BOOTSTRAP_PORT]", help="A prefill server (PD mode); repeat for more.")
    parser.add_argument("--decode", dest="decode", action="append", nargs="+", default=[], metavar="URL",
                        help="A decode server (PD mode); repeat for more.")


def pd_servers_from_cli(values: list) -> tuple:
    """[[url, port?], ...] or [[url], ...] as ((url, port), ...) / (url, ...) tuples."""
    return tuple(tuple(v) if len(v) > 1 else v[0] for v in values)


def parse_prefill(entry: Any) -> tuple[str, int]:
    """One --prefill value: (url, bootstrap port)."""
    from kvstrata.router.args import check_worker_url

    url, *rest = (entry,) if isinstance(entry, str) else tuple(entry)
    if len(rest) > 1:
        raise ConfigError(f"--prefill takes URL [BOOTSTRAP_PORT], got {entry!r}")
    port = DEFAULT_BOOTSTRAP_PORT
    if rest and str(rest[0]).lower() != "none":
        try:
            port = int(rest[0])
        except ValueError:
            raise ConfigError(f"--prefill {url}: the bootstrap port must be an integer, got {rest[0]!r}") from None
        if not 0 < port <= 65535:
            raise ConfigError(f"--prefill {url}: bootstrap port {port} is not in 1..65535")
    return check_worker_url(url), port


def check_pd_args(args: Any) -> None:
    """PD settings are consistent: prefill and decode servers given iff --pd-disaggregation."""
    if not args.pd_disaggregation:
        if args.prefill or args.decode:
            raise ConfigError("--prefill/--decode need --pd-disaggregation")
        return
    if not args.prefill or not args.decode:
        raise ConfigError("--pd-disaggregation needs at least one --prefill and one --decode server")
    if args.worker_urls:
        raise ConfigError("--worker-urls cannot be mixed with --pd-disaggregation (use --prefill/--decode)")
    for entry in args.prefill:
        parse_prefill(entry)
    from kvstrata.router.args import check_worker_url

    for url in args.decode:
        check_worker_url(url if isinstance(url, str) else url[0])


def pd_worker_urls(args: Any) -> list[str]:
    """Every prefill and decode URL (the router health-checks and load-polls them all)."""
    if not args.pd_disaggregation:
        return []
    decode = [u if isinstance(u, str) else u[0] for u in args.decode]
    return [parse_prefill(e)[0] for e in args.prefill] + [u.rstrip("/") for u in decode]


# ---------------------------------------------------------------------- routing
class PDRouter:
    """Pair selection, the bootstrap fields, both requests, and the merged answer."""

    def __init__(self, args: Any, workers: WorkerRegistry, proxy: Proxy):
        self.workers = workers
        self.proxy = proxy
        self.bootstrap_ports = dict(parse_prefill(e) for e in args.prefill)
        self.prefill_policy: Policy = make_policy(dataclasses.replace(args, policy=args.prefill_policy))
        self.decode_policy: Policy = make_policy(dataclasses.replace(args, policy=args.decode_policy))

    def _pick(self, key) -> tuple[Optional[Worker], Optional[Worker]]:
        routable = self.workers.routable()
        prefills = [w for w in routable if w.url in self.bootstrap_ports]
        decodes = [w for w in routable if w.url not in self.bootstrap_ports]
        p = self.prefill_policy.select(prefills, key).worker if prefills else None
        d = self.decode_policy.select(decodes, key).worker if decodes else None
        return p, d

    async def route(self, request: Request, reveal: bool = False) -> Response:
        """Serve one generation request through a prefill/decode pair (named by URL in errors if `reveal`)."""
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            return error_response("the request body must be a JSON object", 400)
        key = route_key(request.url.path, raw)
        p, d = self._pick(key)
        if p is None or d is None:
            return error_response(f"no healthy {'prefill' if p is None else 'decode'} server", 503)
        self.prefill_policy.record(p, key)
        self.decode_policy.record(d, key)
        body = {**body, "bootstrap_host": urlsplit(p.url).hostname, "bootstrap_port": self.bootstrap_ports[p.url],
                "bootstrap_room": random.getrandbits(63)}
        p.begin(0)
        d.begin(0)
        prefill = asyncio.ensure_future(self._post(p, request, {**body, "stream": False}))
        prefill.add_done_callback(lambda fut: _ended(p, fut))
        streaming = False
        try:
            decode = await self._send(d, request, body)
            if decode.content_type == "text/event-stream" and decode.status == 200:
                streaming = True        # the relay ends d's request
                return StreamingResponse(self._relay(d, decode, prefill), status_code=200,
                                         headers=response_headers(decode))
            return await self._answer(request, body, decode, prefill)
        except FAILURES as e:
            prefill.cancel()
            name = worker_name(d.url, d.id, reveal)
            return error_response(f"the decode server {name} failed: {type(e).__name__}", 502)
        finally:
            if not streaming:
                d.end(0, True)

    async def _answer(self, request: Request, body: dict, decode: aiohttp.ClientResponse,
                      prefill: asyncio.Future) -> Response:
        try:
            data = await _until_disconnect(request, decode.read())
        finally:
            decode.release()
        if data is None or decode.status != 200:
            prefill.cancel()          # client gone, or the decode refused: the prefill side aborts too
            return Response(data or b"", status_code=decode.status if data else 499,
                            headers=response_headers(decode))
        data = await self._merge_prompt_logprobs(request, body, data, prefill)
        return Response(data, status_code=200, headers=response_headers(decode))

    async def _relay(self, d: Worker, decode: aiohttp.ClientResponse, prefill: asyncio.Future) -> AsyncIterator[bytes]:
        """The decode server's event stream; closing it (client gone) closes both connections."""
        try:
            async for chunk in decode.content.iter_any():
                yield chunk
        except FAILURES as e:
            yield b"\n\n" + stream_error(f"the decode server failed mid-stream: {type(e).__name__}")
        finally:
            decode.close()
            d.end(0, True)
            if not prefill.done():
                prefill.cancel()

    async def _merge_prompt_logprobs(self, request: Request, body: dict, data: bytes,
                                     prefill: asyncio.Future) -> bytes:
        """Native /generate with logprobs: the prompt's come from the prefill server."""
        if request.url.path != "/generate" or not body.get("return_logprob"):
            return data
        try:
            status, pdata = await prefill
            theirs = json.loads(pdata)["meta_info"]
            ours = json.loads(data)
        except (asyncio.CancelledError, ValueError, KeyError, TypeError, *FAILURES):
            return data
        if status != 200 or not isinstance(ours, dict):
            return data
        for name in ("input_token_logprobs", "input_top_logprobs"):
            if name in theirs:
                ours["meta_info"][name] = theirs[name]
        return json.dumps(ours).encode()

    async def _send(self, w: Worker, request: Request, body: dict) -> aiohttp.ClientResponse:
        assert self.proxy.session is not None
        timeout = aiohttp.ClientTimeout(total=self.proxy.args.request_timeout_secs, sock_connect=5.0)
        headers = self.proxy.worker_headers(w, {"content-type": "application/json"})
        return await self.proxy.session.post(w.url + request.url.path, data=json.dumps(body).encode(),
                                             headers=headers, timeout=timeout)

    async def _post(self, w: Worker, request: Request, body: dict) -> tuple[int, bytes]:
        """POST and read the whole answer (the prefill side); cancelling it closes the connection."""
        resp = await self._send(w, request, body)
        try:
            return resp.status, await resp.read()
        finally:
            resp.close()


def _ended(w: Worker, fut: asyncio.Future) -> None:
    """The prefill side's request is over (its outcome was either merged or is not needed)."""
    w.end(0, True)
    if not fut.cancelled():
        fut.exception()      # retrieved: a failed prefill is reported by the decode side


async def _until_disconnect(request: Request, work) -> Optional[bytes]:
    """Await `work`; None (and `work` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
