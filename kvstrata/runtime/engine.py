"""Engine: the offline API — load a model in this process and generate, without HTTP.

    engine = kvstrata.Engine(model_path="tiny", max_total_tokens=4096)
    out = engine.generate("Hello", {"temperature": 0, "max_new_tokens": 8})
    engine.shutdown()

The scheduler runs in a background thread; `generate` blocks until done, `async_generate` awaits or
streams. Results have SGLang's shape: {"text", "output_ids", "meta_info": {...}}.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from kvstrata.args import ServerArgs
from kvstrata.runtime.loop import SchedulerLoop
from kvstrata.runtime.messages import (
    AbortReq,
    BatchOutput,
    ControlOut,
    FlushCacheReq,
    GetStateReq,
    ReqOutput,
    TokenizedGenerateReq,
)
from kvstrata.runtime.sampling_params import InvalidRequest, SamplingParams
from kvstrata.runtime.scheduler import Scheduler

Prompt = Union[str, list[str], None]
TokenIds = Union[list[int], list[list[int]], None]


@dataclass
class _Pending:
    """What the engine has received so far for one request id."""

    rid: str
    sampling: SamplingParams
    start_time: float
    output_ids: list[int] = field(default_factory=list)
    last: Optional[ReqOutput] = None
    output_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_logprobs: Any = None
    input_top_logprobs: Any = None
    done: threading.Event = field(default_factory=threading.Event)
    listeners: list = field(default_factory=list)    # (asyncio loop, asyncio.Queue) of streaming callers


class Engine:
    """In-process engine over a Scheduler thread."""

    def __init__(self, model_path: str = "tiny", **kwargs: Any):
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs).resolve()
        self.scheduler = Scheduler(self.server_args)
        self.tokenizer = self.scheduler.stop.tokenizer
        self._inbox: queue.Queue = queue.Queue()
        self._control: queue.Queue = queue.Queue()
        self._pending: dict[str, _Pending] = {}
        self._control_lock = threading.Lock()
        self._counter = itertools.count()
        self._loop = SchedulerLoop(self.scheduler, self._recv, self._dispatch)
        self._thread = threading.Thread(target=self._run, name="kvstrata-scheduler", daemon=True)
        self._error: Optional[BaseException] = None
        self._thread.start()

    # ------------------------------------------------------------------ public API
    def generate(self, prompt: Prompt = None, sampling_params: Union[dict, list[dict], None] = None,
                 input_ids: TokenIds = None, return_logprob: bool = False, logprob_start_len: Optional[int] = None,
                 top_logprobs_num: int = 0, return_text_in_logprobs: bool = False,
                 cache_salt: Optional[str] = None) -> Union[dict, list[dict]]:
        """Generate for one prompt (returns a dict) or a list of prompts (returns a list, i*n+j order).

        Requests with different `cache_salt` never share cached KV.
        """
        rids, batched = self._submit(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                     top_logprobs_num, stream=False, cache_salt=cache_salt)
        results = []
        for rid in rids:
            self._wait(rid)
            results.append(self._result(rid, return_text_in_logprobs))
            self._pending.pop(rid, None)
        return results if batched else results[0]

    async def async_generate(self, prompt: Prompt = None, sampling_params: Optional[dict] = None,
                             input_ids: TokenIds = None, stream: bool = False, return_logprob: bool = False,
                             logprob_start_len: Optional[int] = None, top_logprobs_num: int = 0
                             ) -> Union[dict, AsyncIterator[dict]]:
        """Await the result of one prompt, or (stream=True) get an async iterator of cumulative chunks."""
        if isinstance(prompt, list) or (input_ids and isinstance(input_ids[0], list)):
            raise InvalidRequest("async_generate takes one prompt; call it once per prompt")
        if stream and SamplingParams.from_dict(sampling_params).n > 1:
            raise InvalidRequest("stream=True supports n == 1 only")
        aloop = asyncio.get_running_loop()
        aq: asyncio.Queue = asyncio.Queue()
        rids, _ = self._submit(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                               top_logprobs_num, stream=stream, listener=(aloop, aq))
        if not stream:
            while not all(self._pending[r].done.is_set() for r in rids):
                await aq.get()
            results = [self._result(rid, False) for rid in rids]
            for rid in rids:
                self._pending.pop(rid, None)
            return results[0] if len(results) == 1 else results
        return self._stream(rids[0], aq)

    async def _stream(self, rid: str, aq: asyncio.Queue) -> AsyncIterator[dict]:
        try:
            while True:
                p = await aq.get()
                finished = p.done.is_set()     # read before building the chunk: later tokens come next time
                yield self._result(rid, False)
                if finished:
                    return
        finally:
            if rid in self._pending and not self._pending[rid].done.is_set():
                self.abort_request(rid)        # the consumer walked away: free the request's KV
            self._pending.pop(rid, None)

    def abort_request(self, rid: str) -> None:
        """Abort a running request by id."""
        self._inbox.put(AbortReq(rid))

    def flush_cache(self) -> ControlOut:
        """Empty the prefix cache (fails while requests run)."""
        return self._control_call(FlushCacheReq())

    def get_server_info(self) -> dict:
        """Server args and scheduler state (pool occupancy, cache metrics)."""
        state = self._control_call(GetStateReq()).state
        return {**self.server_args.to_dict(), "internal_states": [state]}

    def _control_call(self, msg: object) -> ControlOut:
        with self._control_lock:          # one control question at a time: answers carry no id
            self._check_alive()
            self._inbox.put(msg)
            return self._control.get(timeout=60)

    def shutdown(self) -> None:
        """Stop the scheduler thread."""
        self._inbox.put(None)
        self._thread.join(timeout=30)
        self.scheduler.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ internals
    def _submit(self, prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
                stream, listener=None, cache_salt: Optional[str] = None) -> tuple[list[str], bool]:
        self._check_alive()
        prompts, batched = _as_token_lists(self.tokenizer, prompt, input_ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequest(f"{len(params)} sampling_params for {len(prompts)} prompts")
        start = -1 if logprob_start_len is None else logprob_start_len
        rids = []
        msgs = []
        for ids, p in zip(prompts, params):
            sp = SamplingParams.from_dict(p)
            for j in range(sp.n):
                copy = SamplingParams(**{**sp.__dict__, "n": 1})
                if sp.sampling_seed is not None:
                    copy.sampling_seed = sp.sampling_seed + j
                rid = f"engine-{next(self._counter)}-{uuid.uuid4().hex[:6]}"
                pend = _Pending(rid, copy, time.perf_counter())
                if listener is not None:
                    pend.listeners.append(listener)
                self._pending[rid] = pend
                rids.append(rid)
                msgs.append(TokenizedGenerateReq(rid, ids, copy, return_logprob, start, top_logprobs_num,
                                                 stream=stream, cache_namespace=cache_salt))
        for m in msgs:
            self._inbox.put(m)
        return rids, batched

    def _wait(self, rid: str) -> None:
        pend = self._pending[rid]
        while not pend.done.wait(timeout=0.5):
            self._check_alive()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the scheduler thread died: {self._error!r}") from self._error
        if not self._thread.is_alive():
            raise RuntimeError("the engine is shut down")

    def _run(self) -> None:
        try:
            self._loop.run()
        except BaseException as e:  # surface to callers instead of hanging them
            self._error = e
            for pend in list(self._pending.values()):
                pend.done.set()
            raise

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
            self._control.put(obj)
            return
        assert isinstance(obj, BatchOutput)
        for out in obj.outputs:
            pend = self._pending.get(out.rid)
            if pend is None:
                continue
            pend.output_ids.extend(out.new_token_ids)
            pend.output_logprobs.extend(out.output_token_logprobs)
            pend.output_top_logprobs.extend(out.output_top_logprobs)
            if out.input_token_logprobs is not None:
                pend.input_logprobs, pend.input_top_logprobs = out.input_token_logprobs, out.input_top_logprobs
            pend.last = out
            if out.finished:
                pend.done.set()
            for aloop, aq in pend.listeners:
                try:
                    aloop.call_soon_threadsafe(aq.put_nowait, pend)
                except RuntimeError:           # the caller's event loop is gone: nobody is listening
                    pass

    def _result(self, rid: str, text_in_logprobs: bool) -> dict:
        pend = self._pending[rid]
        if self._error is not None:
            raise RuntimeError(f"the scheduler thread died: {self._error!r}") from self._error
        last = pend.last
        if last is not None and last.error:
            raise InvalidRequest(last.error)
        s = pend.sampling
        text = self.tokenizer.decode(pend.output_ids, skip_special_tokens=s.skip_special_tokens)
        reason = last.finish_reason if last is not None and last.finished else None
        text = trim_stop(text, reason, s.no_stop_trim)
        meta = {"id": rid, "prompt_tokens": last.prompt_tokens if last else 0,
                "completion_tokens": len(pend.output_ids), "cached_tokens": last.cached_tokens if last else 0,
                "finish_reason": reason, "e2e_latency": time.perf_counter() - pend.start_time}
        if pend.input_logprobs is not None or pend.output_logprobs:
            fmt = self._fmt_logprobs if text_in_logprobs else _plain_logprobs
            meta["input_token_logprobs"] = fmt(pend.input_logprobs or [])
            meta["output_token_logprobs"] = fmt(pend.output_logprobs)
            meta["input_top_logprobs"] = [None if t is None else fmt(t) for t in (pend.input_top_logprobs or [])]
            meta["output_top_logprobs"] = [fmt(t) for t in pend.output_top_logprobs]
        return {"text": text, "output_ids": list(pend.output_ids), "meta_info": meta}

    def _fmt_logprobs(self, items) -> list:
        return [[lp, tid, self.tokenizer.decode([tid])] for lp, tid in items]


def trim_stop(text: str, finish_reason: Optional[dict], no_stop_trim: bool) -> str:
    """Cut the matched stop string (and anything after it) from the end of `text`."""
    if no_stop_trim or not finish_reason or finish_reason.get("type") != "stop":
        return text
    matched = finish_reason.get("matched")
    if isinstance(matched, str) and matched:
        pos = text.find(matched)
        if pos >= 0:
            return text[:pos]
    return text


def _plain_logprobs(items) -> list:
    return [[lp, tid, None] for lp, tid in items]


def _as_token_lists(tokenizer, prompt: Prompt, input_ids: TokenIds) -> tuple[list[list[int]], bool]:
    """Normalize text / token-id input (single or batch) into a list of token-id lists."""
    if (prompt is None) == (input_ids is None):
        raise InvalidRequest("give exactly one of prompt (text) and input_ids")
    if prompt is not None:
        if isinstance(prompt, str):
            return [tokenizer.encode(prompt)], False      # with special tokens (BOS), like /generate
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [tokenizer.encode(p) for p in prompt], True
        raise InvalidRequest("prompt must be a string or a non-empty list of strings")
    if isinstance(input_ids, list) and input_ids and all(isinstance(t, int) for t in input_ids):
        return [list(input_ids)], False
    if isinstance(input_ids, list) and input_ids and all(
            isinstance(x, list) and all(isinstance(t, int) for t in x) for x in input_ids):
        return [list(x) for x in input_ids], True
    raise InvalidRequest("input_ids must be a list of ints or a non-empty list of lists of ints")
