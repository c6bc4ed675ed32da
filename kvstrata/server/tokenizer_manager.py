"""TokenizerManager: the HTTP process's side of the scheduler link.

It is the HTTP transport of the shared request frontend (frontend.py: tokenizing, validation,
n-expansion): it sends each output sequence to the scheduler over ZMQ, routes the scheduler's deltas back
to the waiting coroutines, and aborts the scheduler side of any request whose client went away.

Sockets: a plain (blocking-API) PUSH socket for sending — sends are non-blocking and can be made from
`finally` blocks of cancelled coroutines — and an asyncio PULL socket read by one receive task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import zmq
import zmq.asyncio

from kvstrata.args import ServerArgs
from kvstrata.runtime.messages import (
    AbortReq,
    BatchOutput,
    ControlOut,
    FlushCacheReq,
    GetLoadReq,
    GetStateReq,
    PrefetchReq,
    SchedulerReady,
)
from kvstrata.server import frontend
from kvstrata.server.frontend import RequestLimits, TokenTexts
from kvstrata.server.metrics import ServerMetrics
from kvstrata.server.protocol import ApiError, GenerateRequest
from kvstrata.server.request_log import RequestLog
from kvstrata.server.seq_state import SeqState

logger = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    """The HTTP client closed its connection before its request finished."""


class TokenizerManager:
    """Tokenize → send to the scheduler → collect outputs; one per server process."""

    def __init__(self, args: ServerArgs, tokenizer: Any, info: SchedulerReady, recv_addr: str,
                 send_addr: str):
        self.args = args
        self.tokenizer = tokenizer
        self.info = info
        self._sync_ctx = zmq.Context()
        self._push = self._sync_ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 100_000)
        self._push.connect(recv_addr)
        self._async_ctx = zmq.asyncio.Context()
        self._pull = self._async_ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 0)    # never make the scheduler's send block on us
        self._pull.connect(send_addr)
        self.states: dict[str, SeqState] = {}
        self.groups: dict[str, list[str]] = {}     # user rid → the rids of its output sequences
        self._control: dict[str, deque[asyncio.Future]] = defaultdict(deque)
        self._recv_task: Optional[asyncio.Task] = None
        self.release_hooks: list[Callable[[SeqState], None]] = []   # each sees every sequence once, at its end
        self.token_text = TokenTexts(tokenizer)     # the text of one token, as shown next to logprobs
        self.dead_reason: Optional[str] = None
        self.draining_reason: Optional[str] = None   # set on SIGTERM: new requests get 503
        # Tokenizing and rendering chat templates run here, off the event loop, so a huge prompt never
        # delays other requests' streams or /health.
        self._cpu_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstrata-tokenize")
        self.limits = RequestLimits.of(info, tokenizer)
        self.metrics = {"requests_total": 0, "prompt_tokens_total": 0, "generation_tokens_total": 0,
                        "cached_tokens_total": 0, "aborted_requests_total": 0, "failed_requests_total": 0}
        self.prometheus = ServerMetrics(args.served_model_name or args.model_path)
        self.request_log = RequestLog(args)

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Start the receive loop (call from the running event loop)."""
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def close(self) -> None:
        """Stop the receive loop and close the sockets."""
        if self._recv_task is not None:
            self._recv_task.cancel()
            try:
                await self._recv_task
            except (asyncio.CancelledError, Exception):
                pass
        self._cpu_pool.shutdown(wait=False, cancel_futures=True)
        self._pull.close(0)
        self._push.close(0)
        self._async_ctx.term()
        self._sync_ctx.term()

    def mark_dead(self, reason: str) -> None:
        """The scheduler is gone: fail every pending request and refuse new ones with 503."""
        self.dead_reason = reason
        for state in list(self.states.values()):
            state.fail(reason, 503)
        for waiters in self._control.values():
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_exception(ApiError(reason, 503))

    @property
    def context_length(self) -> int:
        """The model's context length as the scheduler uses it."""
        return self.info.context_length

    # ------------------------------------------------------------------ tokenizer helpers
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    async def run_blocking(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run CPU-heavy tokenizer work in the tokenizer threads and await it."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu_pool, lambda: fn(*args, **kwargs))

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """400 when `chars` characters are already more tokens than the context holds (no tokenizing needed)."""
        frontend.check_prompt_chars(chars, self.limits, param)

    async def tokenize(self, req: GenerateRequest) -> None:
        """Fill in `input_ids` of the text prompts of `req`, off the event loop; rejects overlong ones first."""
        texts = frontend.text_prompts(req, self.limits)
        if texts:
            await self.run_blocking(frontend.encode_prompts, texts, self.tokenizer)

    # ------------------------------------------------------------------ generation
    def submit(self, req: GenerateRequest) -> list[SeqState]:
        """Validate, expand and send every sequence of tokenized `req`; returns them in response order (i*n+j)."""
        self._check_alive()
        for p in req.prompts:
            if p.rid in self.groups or p.rid in self.states:
                raise ApiError(f"a request with rid '{p.rid}' is already running", param="rid")
        states = frontend.expand_sequences(req, self.limits, self.tokenizer, asyncio.Event())
        for state in states:
            self.states[state.rid] = state
            self.groups.setdefault(state.group_rid, []).append(state.rid)
        try:
            for state in states:
                self._send(frontend.scheduler_request(req, state))
        except ApiError:
            self.release(states)
            raise
        self.metrics["requests_total"] += len(req.prompts)
        self.request_log.submitted(req, states)
        return states

    async def updates(self, states: list[SeqState],
                      disconnected: Optional[asyncio.Future] = None) -> AsyncIterator[list[SeqState]]:
        """Yield the sequences that changed, until all are done; aborts the unfinished ones on exit.

        `disconnected`: completes when the client goes away (raises ClientDisconnected then).
        """
        try:
            async with contextlib.aclosing(frontend.sequence_updates(
                    states, lambda wake: self._wait(wake, disconnected))) as updates:
                async for changed in updates:
                    yield changed
        finally:
            self.release(states)

    async def _wait(self, wake: asyncio.Event, disconnected: Optional[asyncio.Future]) -> None:
        if disconnected is None:
            await wake.wait()
            return
        waiter = asyncio.ensure_future(wake.wait())
        try:
            await asyncio.wait([waiter, disconnected], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if disconnected.done() and not wake.is_set():
            raise ClientDisconnected()

    async def wait_first(self, states: list[SeqState], disconnected: Optional[asyncio.Future] = None) -> None:
        """Wait until any sequence has output (or an error), without consuming it."""
        wake = states[0].wake
        while not any(s.pending or s.finished for s in states):
            wake.clear()
            if any(s.pending or s.finished for s in states):
                return
            await self._wait(wake, disconnected)

    def release(self, states: list[SeqState]) -> None:
        """Forget `states`; abort the scheduler side of those not finished (idempotent)."""
        for s in states:
            if self.states.pop(s.rid, None) is None:
                continue
            self.prometheus.observe(s)
            self.request_log.released(s)
            if not s.finished:
                self.metrics["aborted_requests_total"] += 1
                self._try_send(AbortReq(rid=s.rid))
                s.fail("aborted: the client went away", 499)
            elif s.error is not None:
                self.metrics["failed_requests_total"] += 1
            self.metrics["prompt_tokens_total"] += s.prompt_tokens
            self.metrics["generation_tokens_total"] += s.completion_tokens
            self.metrics["cached_tokens_total"] += s.cached_tokens
            for hook in self.release_hooks:
                hook(s)
            members = self.groups.get(s.group_rid)
            if members is not None and not any(m in self.states for m in members):
                del self.groups[s.group_rid]

    def abort_request(self, rid: Optional[str] = None, abort_all: bool = False) -> int:
        """Abort a request by its user rid (all its sequences) or a sequence rid; returns how many were running."""
        if abort_all:
            rids = list(self.states)
        elif rid in self.groups:
            rids = [r for r in self.groups[rid] if r in self.states]
        else:
            rids = [rid] if rid in self.states else []
        for r in rids:
            self._try_send(AbortReq(rid=r))
        return len(rids)

    def end_all(self, message: str) -> int:
        """End every running sequence now (shutdown): the scheduler frees them, their clients get a clean end."""
        states = [s for s in self.states.values() if not s.finished]
        for state in states:
            self._try_send(AbortReq(rid=state.rid))
            state.end_now(message, 503)
        return len(states)

    # ------------------------------------------------------------------ control requests
    async def flush_cache(self) -> ControlOut:
        """Ask the scheduler to empty its prefix cache."""
        return await self._control_call(FlushCacheReq(), "flush_cache")

    async def get_state(self, full: bool = True) -> dict:
        """The scheduler's internal state and metrics (`full=False`: without the costly parts)."""
        return (await self._control_call(GetStateReq(full), "state")).state

    def send_prefetch(self, input_ids: list[int], cache_namespace: Optional[str] = None) -> None:
        """Hand the scheduler a prefetch hint (no answer: it is a hint)."""
        self._check_alive()
        self._send(PrefetchReq(input_ids, cache_namespace))

    async def get_load(self) -> dict:
        """The scheduler's O(1) load report (queues, pool, hits per tier)."""
        return (await self._control_call(GetLoadReq(), "load")).state

    async def _control_call(self, msg: Any, kind: str, timeout: float = 20.0) -> ControlOut:
        self._check_alive()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._control[kind].append(fut)
        try:
            self._send(msg)
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise ApiError(f"the scheduler did not answer a {kind} request within {timeout:.0f} s", 503) from None
        finally:
            if fut in self._control[kind]:
                self._control[kind].remove(fut)

    # ------------------------------------------------------------------ transport
    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise ApiError(self.dead_reason, 503)
        if self.draining_reason is not None:
            raise ApiError(self.draining_reason, 503)

    def _send(self, msg: Any) -> None:
        try:
            self._push.send_pyobj(msg, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise ApiError("the scheduler is not accepting requests (queue full)", 503) from None

    def _try_send(self, msg: Any) -> None:
        try:
            self._send(msg)
        except (ApiError, zmq.ZMQError) as e:
            logger.warning("could not send %s to the scheduler: %s", type(msg).__name__, e)

    async def _recv_loop(self) -> None:
        while True:
            try:
                msg = await self._pull.recv_pyobj()
            except asyncio.CancelledError:
                raise
            except zmq.ContextTerminated:
                return
            except Exception:
                logger.exception("bad message from the scheduler")
                continue
            self._dispatch(msg)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchOutput):
            for out in msg.outputs:
                state = self.states.get(out.rid)
                if state is not None:
                    state.push(out)
        elif isinstance(msg, ControlOut):
            waiters = self._control[msg.kind]
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_result(msg)
                    break
        else:
            logger.error("unexpected message from the scheduler: %r", type(msg).__name__)

