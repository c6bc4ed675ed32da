"""EngineBackend: a lang backend over an in-process `kvstrata.Engine` (no HTTP).

    backend = EngineBackend(model_path="tiny", max_total_tokens=8192)   # owns (and shuts down) its engine
    backend = EngineBackend(engine)                                     # borrows an existing engine

Prompts are tokenized here the way the HTTP server tokenizes them, so a program gives the same greedy
result through both backends.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Optional, TypeVar

from kvstrata.lang.backends.base import Backend, BackendError, GenOutput, LogprobEntry
from kvstrata.lang.sampling import SamplingArgs

if TYPE_CHECKING:
    from kvstrata.engine import Engine

STREAM_EVENT_TIMEOUT_S = 600.0     # the longest wait for the next streamed chunk before giving up

T = TypeVar("T")


class EngineBackend(Backend):
    """Backend over a kvstrata.Engine in this process."""

    def __init__(self, engine: Optional[Engine] = None, chat_template: Optional[str] = None,
                 **engine_kwargs: Any):
        super().__init__(chat_template)
        if engine is None:
            from kvstrata.engine import Engine

            engine = Engine(**engine_kwargs)
            self._owns_engine = True
        else:
            if engine_kwargs:
                raise TypeError(f"engine arguments {sorted(engine_kwargs)} given with an existing engine")
            self._owns_engine = False
        self.engine = engine
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_thread: Optional[threading.Thread] = None
        self._loop_lock = threading.Lock()

    # ------------------------------------------------------------------ generation
    def generate(self, prompt: str, args: SamplingArgs) -> GenOutput:
        """Engine.generate on the tokenized prompt."""
        ids = self.encode(prompt)
        out = _engine_call(lambda: self.engine.generate(
            input_ids=ids, sampling_params=args.sampling_params(), **_logprob_kwargs(args)))
        return GenOutput(out["text"], out["meta_info"])

    def generate_stream(self, prompt: str, args: SamplingArgs) -> Iterator[GenOutput]:
        """Engine.async_generate(stream=True), pumped on the backend's event-loop thread."""
        ids = self.encode(prompt)
        kwargs = _logprob_kwargs(args)
        kwargs.pop("return_text_in_logprobs", None)   # not an async_generate argument
        inbox: queue.Queue = queue.Queue()
        pump = asyncio.run_coroutine_threadsafe(
            self._pump(ids, args.sampling_params(), kwargs, inbox), self._event_loop())
        try:
            last: Optional[dict] = None
            while True:
                try:
                    item = inbox.get(timeout=STREAM_EVENT_TIMEOUT_S)
                except queue.Empty:
                    raise BackendError(f"the engine produced nothing for {STREAM_EVENT_TIMEOUT_S:.0f} s") from None
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    err = _backend_error(item)
                    if err is item:
                        raise item
                    raise err from item
                last = item
                yield GenOutput(item["text"], item["meta_info"])
            if last is not None and last["meta_info"].get("finish_reason") is None:
                # Engine._stream can return after a chunk computed just before the request finished.
                raise BackendError("the engine's stream ended before its final chunk (finish_reason missing)")
        finally:
            pump.cancel()

    async def _pump(self, ids: list[int], sampling: dict, kwargs: dict, inbox: queue.Queue) -> None:
        """Move stream chunks into `inbox` as soon as they come (the engine's generator resumes at once)."""
        try:
            chunks = await self.engine.async_generate(input_ids=ids, sampling_params=sampling, stream=True,
                                                      **kwargs)
            try:
                async for chunk in chunks:
                    inbox.put(chunk)
            finally:
                await chunks.aclose()
            inbox.put(_END)
        except Exception as e:      # handed to the reading thread
            inbox.put(e)

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The backend's event loop, running in its own thread (started on first use)."""
        # One long-lived loop, not one per call: the engine's scheduler thread posts stream events to
        # the loop of each listener, and posting to a loop that was already closed would kill it.
        with self._loop_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._loop_thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                                     name="kvstrata-engine-backend-loop")
                self._loop_thread.start()
            return self._loop

    def prompt_logprobs(self, input_ids: list[list[int]], logprob_start_len: int) -> list[list[LogprobEntry]]:
        """One batch Engine.generate with `max_new_tokens: 0` returning each prompt's input logprobs."""
        outs = _engine_call(lambda: self.engine.generate(
            input_ids=[list(x) for x in input_ids], sampling_params={"max_new_tokens": 0, "temperature": 0},
            return_logprob=True, logprob_start_len=logprob_start_len))
        return [o["meta_info"]["input_token_logprobs"] for o in outs]

    def cache_prefix(self, prompt: str) -> dict[str, Any]:
        """Prefill `prompt` without generating; it stays in the engine's prefix cache."""
        ids = self.encode(prompt)
        out = _engine_call(lambda: self.engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}))
        return out["meta_info"]

    # ------------------------------------------------------------------ administration
    def flush_cache(self) -> None:
        """Empty the engine's prefix cache (raises BackendError while requests run)."""
        out = self.engine.flush_cache()
        if not out.success:
            raise BackendError(f"flush_cache failed: {out.message}")

    def get_server_info(self) -> dict[str, Any]:
        """The engine's server args and scheduler state."""
        return self.engine.get_server_info()

    def close(self) -> None:
        """Stop the event-loop thread; shut the engine down if this backend created it."""
        with self._loop_lock:
            loop, thread, self._loop, self._loop_thread = self._loop, self._loop_thread, None, None
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            loop.close()
        if self._owns_engine:
            self.engine.shutdown()

    def _load_tokenizer(self) -> Any:
        return self.engine.tokenizer


def _logprob_kwargs(args: SamplingArgs) -> dict[str, Any]:
    if not args.return_logprob:
        return {}
    return {"return_logprob": True, "logprob_start_len": args.logprob_start_len,
            "top_logprobs_num": args.top_logprobs_num, "return_text_in_logprobs": args.return_text_in_logprobs}


def _engine_call(fn: Callable[[], T]) -> T:
    """Run an engine call; its errors (bad request, dead scheduler) become BackendError."""
    try:
        return fn()
    except BackendError:
        raise
    except (ValueError, RuntimeError) as e:      # InvalidRequest is a ValueError
        raise _backend_error(e) from e


def _backend_error(e: BaseException) -> BaseException:
    """BackendError for engine errors (bad request, dead scheduler); other exceptions unchanged."""
    if isinstance(e, (ValueError, RuntimeError)) and not isinstance(e, BackendError):
        return BackendError(f"the engine rejected the request: {e}")
    return e


_END = object()      # end of a pumped stream
