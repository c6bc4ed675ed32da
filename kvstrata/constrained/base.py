"""The grammar backend interface: compile constraints off the model loop, then mask tokens per request.

Kinds of constraint (the `kind` argument):
  - "regex": a regular expression the whole output must match;
  - "json_schema": a JSON Schema, as a JSON string;
  - "json_object": any JSON object (OpenAI `response_format: json_object`); the text is ignored;
  - "ebnf": a GBNF-style grammar whose start rule is `root ::= ...`.

Who calls what: the HTTP process calls `validate` before queuing a request (400 on GrammarError); the
scheduler calls `compile_async` when a request arrives and keeps decoding others until the future is
done; each step it calls `fill_bitmask` for every constrained request into one shared bitmask, and the
sampler calls `apply_bitmask` with the rows of the constrained requests.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

import torch

from kvstrata.constrained import bitmask as bitmask_ops
from kvstrata.constrained.compile_cache import CompileCache, GrammarCacheInfo

GRAMMAR_KINDS = ("regex", "json_schema", "json_object", "ebnf")

_MAX_MESSAGE_CHARS = 600


class GrammarError(ValueError):
    """An invalid regex, schema or grammar; the message carries the compiler's. Servers answer 400."""


class Grammar(ABC):
    """The matcher state of one request: which tokens may come next, given those accepted so far."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this request's allowed tokens into row `row` of a shared CPU bitmask."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar accepted an eos token: the request must end."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (for retraction)."""

    @abstractmethod
    def copy(self) -> Grammar:
        """A fresh matcher (no token accepted) of the same compiled grammar, e.g. for `n` > 1."""


class GrammarBackend(ABC):
    """Compiles constraints against one tokenizer, with an LRU of compiled grammars and a compile pool.

    Subclasses implement `_parse` (fast syntax check), `_compile` (the expensive part, run in the pool)
    and `_new_grammar` (a matcher over a compiled grammar).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], max_workers: int = 1,
                 cache_size: int = 256):
        if not eos_token_ids:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = [] if eos is None else [eos]
        if not eos_token_ids:
            raise ValueError("a grammar backend needs at least one eos token id to end requests")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._cache = CompileCache(cache_size)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")

    # ---- compile -------------------------------------------------------------------------------

    def compile_async(self, kind: str, text: str) -> Future[Grammar]:
        """A future of a fresh Grammar for (kind, text); compiles in the pool unless cached.

        Never blocks on compilation. The future raises GrammarError for an invalid constraint.
        """
        result: Future[Grammar] = Future()
        try:
            key = _cache_key(kind, text)
        except GrammarError as e:
            result.set_exception(e)
            return result
        compiled = self._cache.get_or_start(key, lambda: self._pool.submit(self._compile_counted, *key))
        compiled.add_done_callback(lambda f: self._resolve(f, result))
        return result

    def compile(self, kind: str, text: str) -> Grammar:
        """Blocking convenience over `compile_async`; raises GrammarError."""
        return self.compile_async(kind, text).result()

    def validate(self, kind: str, text: str) -> None:
        """Raise GrammarError if (kind, text) is not a valid constraint; parses only, does not compile."""
        key = _cache_key(kind, text)
        try:
            self._parse(*key)
        except GrammarError:
            raise
        except Exception as e:  # the compiler's own exception types vary; its message is what users need
            raise GrammarError(_describe(kind, e)) from e

    def cache_info(self) -> GrammarCacheInfo:
        """Hits, misses, compiles run, and size of the compiled-grammar cache."""
        return self._cache.info()

    def clear_cache(self) -> None:
        """Forget every compiled grammar."""
        self._cache.clear()

    def close(self) -> None:
        """Stop the compile threads; pending compiles are cancelled."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> GrammarBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- masks ---------------------------------------------------------------------------------

    def allocate_bitmask(self, batch_size: int) -> torch.Tensor:
        """A CPU int32 bitmask `[batch_size, ceil(vocab_size / 32)]`, all tokens allowed."""
        return bitmask_ops.allocate_bitmask(batch_size, self.vocab_size)

    @staticmethod
    def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: Optional[torch.Tensor] = None) -> None:
        """In place: disallowed tokens -> -inf in `rows` of `logits` (all rows when None); others untouched."""
        bitmask_ops.apply_bitmask_torch(logits, bitmask, rows)

    # ---- for subclasses ------------------------------------------------------------------------

    @abstractmethod
    def _parse(self, kind: str, text: str) -> None:
        """Check the syntax of a constraint quickly; raise on error."""

    @abstractmethod
    def _compile(self, kind: str, text: str) -> Any:
        """Compile a constraint against the tokenizer (slow; runs in the pool); raise on error."""

    @abstractmethod
    def _new_grammar(self, compiled: Any) -> Grammar:
        """A fresh matcher over a compiled grammar."""

    def _compile_counted(self, kind: str, text: str) -> Any:
        self._cache.count_compile()
        try:
            return self._compile(kind, text)
        except GrammarError:
            raise
        except Exception as e:
            raise GrammarError(_describe(kind, e)) from e

    def _resolve(self, compiled: Future, result: Future[Grammar]) -> None:
        if compiled.cancelled():
            result.cancel()
            return
        error = compiled.exception()
        if error is not None:
            result.set_exception(error)
            return
        try:
            result.set_result(self._new_grammar(compiled.result()))
        except Exception as e:  # a future that never resolves would hang its request
            result.set_exception(e)


def _cache_key(kind: str, text: str) -> tuple[str, str]:
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"unknown constraint kind {kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")
    if kind == "json_object":
        return kind, ""
    if not isinstance(text, str):
        raise GrammarError(f"{kind} must be a string, got {type(text).__name__}")
    return kind, text


# xgrammar's C++ errors start with "[10:13:04] /project/cpp/file.cc:94: " and sometimes a failed check.
_LOG_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def _describe(kind: str, error: Exception) -> str:
    message = str(error).strip() or type(error).__name__
    message = _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", message))
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[:_MAX_MESSAGE_CHARS] + "..."
    return f"invalid {kind}: {message}"
