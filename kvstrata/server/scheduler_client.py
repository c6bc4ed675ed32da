"""SchedulerClient: the HTTP process's link to the scheduler process (over ZMQ), and its request accounting.

The transport of the shared request frontend (serving/: tokenizing, validation, n-expansion): it sends each
output sequence to the scheduler, hands the scheduler's deltas to the waiting coroutines through the
SequenceRegistry (serving/registry.py: which also aborts the scheduler side of any request whose client
went away), and asks control questions matched by id (serving/control.py). It tokenizes only in the sense
that it runs the frontend's tokenizing off the event loop (SGLang calls this part the SchedulerClient).

Sockets: a plain (blocking-API) PUSH socket for sending — sends are non-blocking and can be made from
`finally` blocks of cancelled coroutines — and an asyncio PULL socket read by one receive task. Messages are
typed msgpack frames (messages.MessageCodec), never pickles.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import zmq
import zmq.asyncio

from kvstrata.args import ServerArgs
from kvstrata.runtime.messages import (
    TO_FRONTEND,
    AbortReq,
    BatchOutput,
    ControlOut,
    ControlReq,
    ExpertDistributionReq,
    FlushCacheReq,
    GetLoadReq,
    GetStateReq,
    MessageCodec,
    MessageRejected,
    PrefetchReq,
    SchedulerReady,
)
from kvstrata.server.metrics import ServerMetrics
from kvstrata.server.request_log import RequestLog
from kvstrata.serving import frontend
from kvstrata.serving.control import ControlCalls
from kvstrata.serving.errors import ApiError
from kvstrata.serving.frontend import RequestLimits, TokenTexts
from kvstrata.serving.protocol import GenerateRequest
from kvstrata.serving.registry import SequenceRegistry
from kvstrata.serving.seq_state import SeqState

logger = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    """The HTTP client closed its connection before its request finished."""


class SchedulerClient:
    """Tokenize → send to the scheduler → collect outputs; one per server process."""

    def __init__(self, args: ServerArgs, tokenizer: Any, info: SchedulerReady, recv_addr: str,
                 send_addr: str):
        self.args = args
        self.tokenizer = tokenizer
        self.info = info
        self._codec = MessageCodec(TO_FRONTEND)
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
        self.sequences = SequenceRegistry(lambda rid: self._try_send(AbortReq(rid=rid)))
        self._control = ControlCalls()
        self._recv_task: Optional[asyncio.Task] = None
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
        self.sequences.release_hooks += [self.prometheus.observe, self.request_log.released, self._count]

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
        self.sequences.fail_all(reason, 503)
        self._control.fail_all(ApiError(reason, 503))

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
        states = frontend.expand_sequences(req, self.limits, self.tokenizer, asyncio.Event())
        self.sequences.register(states)
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
        self.sequences.release(states)

    def _count(self, s: SeqState) -> None:
        """The /server_info counters of one released sequence (a release hook: it sees it before a failure)."""
        if not s.finished:
            self.metrics["aborted_requests_total"] += 1
        elif s.error is not None:
            self.metrics["failed_requests_total"] += 1
        self.metrics["prompt_tokens_total"] += s.prompt_tokens
        self.metrics["generation_tokens_total"] += s.completion_tokens
        self.metrics["cached_tokens_total"] += s.cached_tokens

    def abort_request(self, rid: Optional[str] = None, abort_all: bool = False) -> int:
        """Abort a request by its user rid (all its sequences) or a sequence rid; returns how many were running."""
        return self.sequences.abort(rid, abort_all)

    def end_all(self, message: str) -> int:
        """End every running sequence now (shutdown): the scheduler frees them, their clients get a clean end."""
        return self.sequences.end_all(message, 503)

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

    async def expert_distribution(self, action: str) -> ControlOut:
        """Start, stop or dump the scheduler's expert recorder (Scheduler.expert_distribution: refused unless
        it records)."""
        return await self._control_call(ExpertDistributionReq(action=action), "expert_distribution")

    async def _control_call(self, msg: ControlReq, kind: str, timeout: float = 20.0) -> ControlOut:
        self._check_alive()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        try:
            self._send(self._control.open(msg, fut))
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise ApiError(f"the scheduler did not answer a {kind} request within {timeout:.0f} s", 503) from None
        finally:
            self._control.close(msg)

    # ------------------------------------------------------------------ transport
    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise ApiError(self.dead_reason, 503)
        if self.draining_reason is not None:
            raise ApiError(self.draining_reason, 503)

    def _send(self, msg: Any) -> None:
        try:
            self._push.send(self._codec.encode(msg), flags=zmq.NOBLOCK)
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
                msg = self._codec.decode(await self._pull.recv())
            except asyncio.CancelledError:
                raise
            except zmq.ContextTerminated:
                return
            except MessageRejected as e:
                logger.error("dropped a message from the scheduler's socket: %s", e)
                continue
            except Exception:
                logger.exception("bad message from the scheduler")
                continue
            self._dispatch(msg)
            # A frame already in the socket makes recv() a finished future, and awaiting one does not yield:
            # without this the loop would drain a backlog before any stream writes, merging a request's
            # chunks (--stream-interval would send 1, 9, 13 instead of 1, 5, 9, 13 tokens).
            await asyncio.sleep(0)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchOutput):
            self.sequences.dispatch(msg)
        elif isinstance(msg, ControlOut):
            if not self._control.answer(msg):
                logger.warning("dropped a late %s answer from the scheduler (its caller gave up)", msg.kind)
        else:
            logger.error("unexpected message from the scheduler: %r", type(msg).__name__)

