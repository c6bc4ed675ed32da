"""run_batch: one program over many argument sets, in a thread pool, with its common prefix pre-cached."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Optional, Union

from kvstrata.lang.backends.base import Backend, BackendError
from kvstrata.lang.interpreter import ProgramError
from kvstrata.lang.program import run_program
from kvstrata.lang.sampling import SamplingArgs
from kvstrata.lang.state import ProgramState
from kvstrata.lang.tracer import trace_prefix

MAX_AUTO_THREADS = 64


class BatchError(ProgramError):
    """Some programs of a batch failed; `errors` maps their index to the exception, `states` has the rest."""

    def __init__(self, message: str, errors: dict[int, BaseException], states: list[Optional[ProgramState]]):
        super().__init__(message)
        self.errors = errors
        self.states = states


def run_program_batch(func: Callable[..., Any], backend: Backend, batch_kwargs: Sequence[dict[str, Any]],
                      defaults: SamplingArgs, num_threads: Union[int, str] = "auto",
                      progress_bar: bool = False) -> list[ProgramState]:
    """States in the order of `batch_kwargs`; raises BatchError after all ran if any failed."""
    batch = _check_batch(batch_kwargs)
    if not batch:
        return []
    threads = _thread_count(num_threads, len(batch))
    if len(batch) > 1:
        _precache_prefix(func, backend, batch)
    states: list[Optional[ProgramState]] = [None] * len(batch)
    errors: dict[int, BaseException] = {}
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvstrata-lang-batch") as pool:
        futures = {pool.submit(run_program, func, backend, (), kw, defaults, False): i
                   for i, kw in enumerate(batch)}
        with _progress(len(batch), progress_bar) as bar:
            for future in as_completed(futures):
                i = futures[future]
                try:
                    states[i] = future.result()
                except Exception as e:
                    errors[i] = e
                bar.update(1)
    if errors:
        first = min(errors)
        err = errors[first]
        raise BatchError(f"{len(errors)} of {len(batch)} programs failed; the first (#{first}): "
                         f"{type(err).__name__}: {err}", errors, states) from err
    return states   # type: ignore[return-value]


def _check_batch(batch_kwargs: Any) -> list[dict[str, Any]]:
    if isinstance(batch_kwargs, dict) or not isinstance(batch_kwargs, Sequence):
        raise TypeError("run_batch takes a list of dicts of keyword arguments, one per program")
    for i, kw in enumerate(batch_kwargs):
        if not isinstance(kw, dict):
            raise TypeError(f"run_batch item #{i} must be a dict of keyword arguments, got {type(kw).__name__}")
    return list(batch_kwargs)


def _thread_count(num_threads: Union[int, str], size: int) -> int:
    if num_threads == "auto":
        return max(1, min(size, MAX_AUTO_THREADS, 16 * (os.cpu_count() or 1)))
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be 'auto' or an integer >= 1, got {num_threads!r}")
    return min(num_threads, size)


def _precache_prefix(func: Callable[..., Any], backend: Backend, batch: list[dict[str, Any]]) -> None:
    """Prefill the text every program starts with, once, before they all ask for it."""
    names = sorted({name for kw in batch for name in kw})
    prefix = trace_prefix(func, backend, names)
    if not prefix:
        return
    try:
        backend.cache_prefix(prefix)
    except BackendError:
        pass   # only an optimization; the programs themselves will report a real problem


class _NoBar:
    def update(self, n: int) -> None:
        """Nothing to show."""

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="run_batch", unit="program")
