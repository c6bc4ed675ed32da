"""`@function`: a program is a Python function of a state `s`; `run` executes it once, `run_batch` many times."""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

from kvstrata.lang.api import resolve_backend
from kvstrata.lang.backends.base import Backend
from kvstrata.lang.interpreter import StreamExecutor
from kvstrata.lang.sampling import SamplingArgs, normalize_overrides
from kvstrata.lang.state import ProgramState


class SglFunction:
    """A program: call `.run(...)` (or the object itself) for one state, `.run_batch([...])` for many."""

    def __init__(self, func: Callable[..., Any]):
        if not callable(func):
            raise TypeError(f"@function needs a function, got {func!r}")
        if not inspect.signature(func).parameters:
            raise TypeError(f"program {func.__name__!r} must take the program state as its first parameter")
        self.func = func
        functools.update_wrapper(self, func)

    def run(self, *args: Any, max_new_tokens: int = 128, stop: Union[str, Sequence[str], None] = None,
            stop_token_ids: Optional[Sequence[int]] = None, temperature: float = 1.0, top_p: float = 1.0,
            top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
            repetition_penalty: float = 1.0, ignore_eos: bool = False, return_logprob: bool = False,
            logprob_start_len: Optional[int] = None, top_logprobs_num: Optional[int] = None,
            return_text_in_logprobs: Optional[bool] = None, stream: bool = False,
            backend: Optional[Backend] = None, use_thread: bool = True, **kwargs: Any) -> ProgramState:
        """Run the program once; sampling arguments are defaults for its `gen` calls.

        Without `stream` it returns when the program is done and raises ProgramError if a call failed;
        with `stream=True` it returns at once and `state.text_iter()` yields text as it is produced.
        `use_thread` is accepted for SGLang compatibility: expressions always run on a worker thread,
        which changes no result.
        """
        defaults = make_defaults(
            max_new_tokens=max_new_tokens, stop=stop, stop_token_ids=stop_token_ids, temperature=temperature,
            top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, repetition_penalty=repetition_penalty, ignore_eos=ignore_eos,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs)
        return run_program(self.func, resolve_backend(backend), args, kwargs, defaults, stream)

    def run_batch(self, batch_kwargs: Sequence[dict[str, Any]], *, max_new_tokens: int = 128,
                  stop: Union[str, Sequence[str], None] = None, stop_token_ids: Optional[Sequence[int]] = None,
                  temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
                  frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                  repetition_penalty: float = 1.0, ignore_eos: bool = False, return_logprob: bool = False,
                  logprob_start_len: Optional[int] = None, top_logprobs_num: Optional[int] = None,
                  return_text_in_logprobs: Optional[bool] = None, backend: Optional[Backend] = None,
                  num_threads: Union[int, str] = "auto", progress_bar: bool = False) -> list[ProgramState]:
        """Run the program once per kwargs dict, in a thread pool, after pre-caching its common prefix."""
        from kvstrata.lang.run_batch import run_program_batch

        defaults = make_defaults(
            max_new_tokens=max_new_tokens, stop=stop, stop_token_ids=stop_token_ids, temperature=temperature,
            top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, repetition_penalty=repetition_penalty, ignore_eos=ignore_eos,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, return_text_in_logprobs=return_text_in_logprobs)
        return run_program_batch(self.func, resolve_backend(backend), batch_kwargs, defaults, num_threads,
                                 progress_bar)

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def function(func: Optional[Callable[..., Any]] = None, num_api_spec_tokens: Optional[int] = None) -> Any:
    """Decorator that turns `def prog(s, ...)` into a runnable program (`@function` or `@function()`)."""
    if num_api_spec_tokens is not None:
        raise ValueError("num_api_spec_tokens (API speculative execution) is not supported")
    if func is None:
        return SglFunction
    return SglFunction(func)


def make_defaults(**kwargs: Any) -> SamplingArgs:
    """Run-level sampling defaults, checked (ValueError/TypeError name the bad argument)."""
    args = SamplingArgs().merge(normalize_overrides(**kwargs))
    args.validate()
    return args


def run_program(func: Callable[..., Any], backend: Backend, args: Sequence[Any], kwargs: dict[str, Any],
                defaults: SamplingArgs, stream: bool) -> ProgramState:
    """Run `func(state, *args, **kwargs)`; see SglFunction.run."""
    executor = StreamExecutor(backend, defaults, stream)
    state = ProgramState(executor)
    if stream:
        body = threading.Thread(target=_run_body, args=(func, state, executor, args, kwargs, False),
                                name="kvstrata-lang-program", daemon=True)
        executor.body_thread = body      # readers outside the body wait for it to end
        body.start()
        return state
    _run_body(func, state, executor, args, kwargs, True)
    executor.sync()
    executor.check()
    return state


def _run_body(func: Callable[..., Any], state: ProgramState, executor: StreamExecutor, args: Sequence[Any],
              kwargs: dict[str, Any], reraise: bool) -> None:
    try:
        state.ret_value = func(state, *args, **kwargs)
    except BaseException as e:
        executor.fail(e)       # skip what the body queued before failing
        if reraise:
            raise
    finally:
        executor.end()
