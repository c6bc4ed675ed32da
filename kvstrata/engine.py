"""Engine: the offline API — load a model in this process and generate, without HTTP.

    engine = kvstrata.Engine(model_path="tiny", max_total_tokens=4096)
    out = engine.generate("Hello", {"temperature": 0, "max_new_tokens": 8})
    engine.shutdown()

An entrypoint like launch_server.py, so it sits above serving/ and runtime/ (never server/, the HTTP app:
a test checks). The Engine is the in-process transport of the request frontend the HTTP server uses
(serving/): its arguments are parsed as a `/generate` body, then validated, n-expanded, stop-trimmed and
shaped by the same code, and its sequences are tracked by the same SequenceRegistry, so a request gets the
same result here as from POST /generate, and the same error text (an `InvalidRequest` where HTTP answers
4xx). What is the Engine's own: a scheduler thread, a queue into it, and the hand-over of its outputs to
the caller's thread (`generate`) or event loop (`async_generate`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any, Optional, Union

from kvstrata.args import ServerArgs
from kvstrata.disagg import handoff_for
from kvstrata.runtime.loop import SchedulerLoop
from kvstrata.runtime.messages import (
    AbortReq,
    BatchOutput,
    ControlOut,
    ControlReq,
    ExpertDistributionReq,
    FlushCacheReq,
    GetStateReq,
    ReqOutput,
)
from kvstrata.runtime.sampling_params import InvalidRequest
from kvstrata.runtime.scheduler import Scheduler
from kvstrata.runtime.scheduler_process import ready_message
from kvstrata.serving import frontend
from kvstrata.serving.control import ControlCalls
from kvstrata.serving.errors import ApiError
from kvstrata.serving.frontend import RequestLimits, TokenTexts
from kvstrata.serving.protocol import GenerateRequest, check_no_surrogates, parse_generate
from kvstrata.serving.registry import Deliver, SequenceRegistry
from kvstrata.serving.seq_state import SeqState

Prompt = Union[str, list[str], None]
TokenIds = Union[list[int], list[list[int]], None]
SamplingArg = Union[dict, list[dict], None]
POLL_S = 0.5          # how often a waiting caller checks that the scheduler thread is still alive
SHUTDOWN_JOIN_S = 180.0   # the scheduler thread's close: in-flight copies, the L2 snapshot, the other ranks' stop


class Engine:
    """In-process engine over a Scheduler thread."""

    def __init__(self, model_path: str = "tiny", **kwargs: Any):
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs).resolve()
        self._inbox: queue.Queue = queue.Queue()
        self._control = ControlCalls()
        self._sequences = SequenceRegistry(lambda rid: self._inbox.put(AbortReq(rid)))
        self._error: Optional[BaseException] = None
        self._built = threading.Event()
        self._close_on_stop = False     # shutdown(): the scheduler thread closes the scheduler as it ends
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstrata-scheduler", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._error is not None:
            raise self._error
        self.tokenizer = self.scheduler.tokenizer
        self.limits = RequestLimits.of(ready_message(self.scheduler), self.tokenizer)
        self.token_text = TokenTexts(self.tokenizer)

    # ------------------------------------------------------------------ public API
    def generate(self, prompt: Prompt = None, sampling_params: SamplingArg = None, input_ids: TokenIds = None,
                 return_logprob: Union[bool, list[bool]] = False, logprob_start_len: Union[int, list, None] = None,
                 top_logprobs_num: Union[int, list, None] = None, return_text_in_logprobs: bool = False,
                 cache_salt: Optional[str] = None) -> Union[dict, list[dict]]:
        """Generate for one prompt (a dict; a list when n > 1) or a list of prompts (a list, i*n+j order).

        Arguments mean what the fields of POST /generate mean (`prompt` is its `text`). Requests with
        different `cache_salt` never share cached KV.
        """
        with _engine_errors():
            req = _parse(prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
                         top_logprobs_num, return_text_in_logprobs, cache_salt, stream=False)
            arrived: queue.Queue = queue.Queue()
            states = self._submit(req, threading.Event(), lambda s, out: arrived.put((s, out)))
            try:
                self._collect(len(states), arrived)
                return frontend.native_response(req, states, self.token_text)
            finally:
                self._release(states)

    async def async_generate(self, prompt: Optional[str] = None, sampling_params: Optional[dict] = None,
                             input_ids: Optional[list[int]] = None, stream: bool = False,
                             return_logprob: bool = False, logprob_start_len: Optional[int] = None,
                             top_logprobs_num: Optional[int] = None, return_text_in_logprobs: bool = False,
                             cache_salt: Optional[str] = None) -> Union[dict, list[dict], AsyncIterator[dict]]:
        """Await the result of one prompt, or (stream=True) get an async iterator of its chunks.

        Chunks are those of /generate's stream: cumulative text and output_ids, output logprobs as deltas.
        """
        with _engine_errors():
            req = _parse(prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
                         top_logprobs_num, return_text_in_logprobs, cache_salt, stream=stream)
            if req.is_batch:
                raise InvalidRequest("async_generate takes one prompt; call it once per prompt")
            if stream and req.prompts[0].sampling.n > 1:
                raise InvalidRequest("stream=True supports n == 1 only")
            aloop = asyncio.get_running_loop()
            states = self._submit(req, asyncio.Event(), lambda s, out: _post(aloop, s, out))
        if stream:
            return self._stream(req, states)
        with _engine_errors():
            async with contextlib.aclosing(self._updates(states)) as updates:
                async for changed in updates:
                    frontend.raise_first_error(changed)
            return frontend.native_response(req, states, self.token_text)

    async def _stream(self, req: GenerateRequest, states: list[SeqState]) -> AsyncIterator[dict]:
        with _engine_errors():
            async with contextlib.aclosing(self._updates(states)) as updates:
                async for changed in updates:
                    frontend.raise_first_error(changed)
                    for s in changed:
                        yield frontend.native_output(req, s, self.token_text, delta_logprobs=True)

    def abort_request(self, rid: str) -> None:
        """Abort a running request by id (meta_info's `id`)."""
        self._sequences.abort(rid)

    def flush_cache(self) -> ControlOut:
        """Empty the prefix cache (fails while requests run)."""
        return self._control_call(FlushCacheReq())

    def get_server_info(self) -> dict:
        """Server args and scheduler state (pool occupancy, cache metrics)."""
        state = self._control_call(GetStateReq()).state
        return {**self.server_args.to_dict(), "internal_states": [state]}

    def start_expert_distribution_record(self) -> None:
        """Clear the expert counts and count from now on (InvalidRequest unless the model is MoE and the engine
        has expert_distribution_recorder_mode="stat")."""
        self._expert_distribution("start")

    def stop_expert_distribution_record(self) -> None:
        """Stop counting experts; the counts stay for a dump."""
        self._expert_distribution("stop")

    def dump_expert_distribution_record(self) -> dict:
        """The expert counts since the last start: what /dump_expert_distribution_record returns."""
        return self._expert_distribution("dump").state

    def _expert_distribution(self, action: str) -> ControlOut:
        out = self._control_call(ExpertDistributionReq(action=action))
        if not out.success:
            raise InvalidRequest(out.message)
        return out

    def _control_call(self, msg: ControlReq) -> ControlOut:
        self._check_alive()
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(self._control.open(msg, reply))
        try:
            return reply.result(timeout=60)
        finally:
            self._control.close(msg)

    def detach_scheduler(self):
        """Stop the scheduler thread but keep its scheduler, returned for the caller's thread to drive (the
        engine takes no more requests; the caller closes the scheduler)."""
        self._inbox.put(None)
        self._thread.join(timeout=30)
        return self.scheduler

    def shutdown(self) -> None:
        """Stop the scheduler thread, which closes the scheduler on its way out: under tensor parallelism the
        other ranks die with the thread that started them, so they are stopped (their L3 writes and snapshot
        shares finished) from it. A thread that already ended (a failed loop) leaves the close to this one."""
        self._close_on_stop = True
        self._inbox.put(None)
        self._thread.join(timeout=SHUTDOWN_JOIN_S)
        if not self._closed and not self._thread.is_alive():
            self.scheduler.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ caller side
    def _submit(self, req: GenerateRequest, wake: Any, deliver: Deliver) -> list[SeqState]:
        """Tokenize, validate and expand `req` (the frontend's rules), then queue its sequences."""
        self._check_alive()
        frontend.encode_prompts(frontend.text_prompts(req, self.limits), self.tokenizer)
        states = frontend.expand_sequences(req, self.limits, self.tokenizer, wake)
        self._sequences.register(states, deliver)
        for s in states:
            self._inbox.put(frontend.scheduler_request(req, s))
        return states

    def _collect(self, running: int, arrived: queue.Queue) -> None:
        """Hand outputs to their sequences until `running` of them finished; raises the first error.

        A sequence applies its outputs (detokenizes) once, when it finishes: the caller's thread then
        takes no time from the scheduler thread while the batch runs.
        """
        while running:
            try:
                state, out = arrived.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive()
                continue
            state.push(out)
            if out.finished and not state.finished:
                state.drain()
                frontend.raise_first_error([state])
                running -= 1

    async def _updates(self, states: list[SeqState]) -> AsyncIterator[list[SeqState]]:
        try:
            async with contextlib.aclosing(frontend.sequence_updates(states, self._wait)) as updates:
                async for changed in updates:
                    yield changed
        finally:
            self._release(states)

    async def _wait(self, wake: asyncio.Event) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(wake.wait(), POLL_S)
        self._check_alive()

    def _release(self, states: list[SeqState]) -> None:
        """Forget `states`; abort the scheduler side of those not finished (the caller went away)."""
        self._sequences.release(states)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the scheduler thread died: {self._error!r}") from self._error
        if not self._thread.is_alive():
            raise RuntimeError("the engine is shut down")

    # ------------------------------------------------------------------ scheduler thread
    def _run(self) -> None:
        # The scheduler (model load, weight packing, warm-up) is built on this thread, not the caller's. torch's
        # OpenMP keeps a thread pool for each thread that runs parallel work; with two pools on the machine's
        # cores, libgomp cuts its workers' spin-wait to ~100 spins, so every parallel region wakes them from
        # sleep: a decode step took 16-17 ms here instead of 7-8 (docs/benchmarks.md).
        try:
            self.scheduler = Scheduler(self.server_args,
                                       handoff_factory=handoff_for(self.server_args.disaggregation_mode))
            self._loop = SchedulerLoop(self.scheduler, self._recv, self._dispatch)
        except BaseException as e:  # raised to the constructor's caller
            self._error = e
            return
        finally:
            self._built.set()
        try:
            self._loop.run()
        except BaseException as e:  # surface to callers instead of hanging them
            self._error = e
            raise
        finally:
            if self._close_on_stop:
                self._closed = True
                self.scheduler.close()

    def _recv(self, block: bool) -> list:
        msgs = []
        try:
            msgs.append(self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait())
            while True:
                msgs.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return msgs

    def _dispatch(self, obj: object) -> None:
        if isinstance(obj, ControlOut):
            self._control.answer(obj)
            return
        assert isinstance(obj, BatchOutput)
        self._sequences.dispatch(obj)


def _parse(prompt: Prompt, input_ids: TokenIds, sampling_params: SamplingArg, return_logprob: Any,
           logprob_start_len: Any, top_logprobs_num: Any, return_text_in_logprobs: bool,
           cache_salt: Optional[str], stream: bool) -> GenerateRequest:
    """The Engine's arguments as the /generate body they stand for, parsed by the HTTP server's parser."""
    body = {"text": prompt, "input_ids": input_ids, "sampling_params": sampling_params,
            "return_logprob": return_logprob, "logprob_start_len": logprob_start_len,
            "top_logprobs_num": top_logprobs_num, "return_text_in_logprobs": return_text_in_logprobs,
            "stream": stream, "cache_salt": cache_salt}
    check_no_surrogates(body)
    return parse_generate(body)


def _post(aloop: asyncio.AbstractEventLoop, state: SeqState, out: ReqOutput) -> None:
    """Hand `out` to `state` on its caller's event loop, where all of its changes happen."""
    try:
        aloop.call_soon_threadsafe(state.push, out)
    except RuntimeError:           # the caller's event loop is gone: nobody is listening
        pass


@contextlib.contextmanager
def _engine_errors() -> Iterator[None]:
    """The frontend's HTTP errors as Python exceptions: 4xx → InvalidRequest, 5xx → RuntimeError."""
    try:
        yield
    except ApiError as e:
        if e.status < 500:
            raise InvalidRequest(e.message) from e
        raise RuntimeError(e.message) from e
