"""What the interpreter needs from a backend: generate (whole or streamed), prompt logprobs, prefix caching.

Backends tokenize like SGLang's server does (`add_special_tokens=True`), so that the same program gives
the same prompts, hence the same greedy outputs, through HTTP and in process.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

from kvstrata.lang.chat_template import RoleRenderer
from kvstrata.lang.sampling import SamplingArgs

# A prompt logprob entry as the native API returns it: [logprob or None, token id, token text or None].
LogprobEntry = list


class BackendError(RuntimeError):
    """A backend call failed; the message says what the server or engine answered."""


@dataclass
class GenOutput:
    """One generation result (or, when streaming, the cumulative result so far)."""

    text: str
    meta_info: dict[str, Any]


class Backend(ABC):
    """Base of the lang backends; subclasses speak to one runtime."""

    def __init__(self, chat_template: Optional[str] = None):
        self._chat_template = chat_template
        self._tokenizer: Any = None
        self._renderer: Optional[RoleRenderer] = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ runtime calls
    @abstractmethod
    def generate(self, prompt: str, args: SamplingArgs) -> GenOutput:
        """Generate a continuation of `prompt`."""

    @abstractmethod
    def generate_stream(self, prompt: str, args: SamplingArgs) -> Iterator[GenOutput]:
        """Generate a continuation of `prompt`, yielding the cumulative text as it grows."""

    @abstractmethod
    def prompt_logprobs(self, input_ids: list[list[int]], logprob_start_len: int) -> list[list[LogprobEntry]]:
        """Score prompts without generating: each prompt's entries from `logprob_start_len` on (first: None)."""

    @abstractmethod
    def cache_prefix(self, prompt: str) -> dict[str, Any]:
        """Prefill `prompt` without generating so that later requests sharing it hit the cache; its meta_info."""

    @abstractmethod
    def flush_cache(self) -> None:
        """Empty the runtime's prefix cache."""

    @abstractmethod
    def get_server_info(self) -> dict[str, Any]:
        """The runtime's server args and internal state."""

    @abstractmethod
    def _load_tokenizer(self) -> Any:
        """Load the tokenizer that the runtime uses."""

    def close(self) -> None:  # noqa: B027 -- most backends hold nothing to release
        """Release what the backend holds (connections, an owned engine)."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ tokenizer and chat template
    @property
    def tokenizer(self) -> Any:
        """The runtime's tokenizer (loaded once, on first use)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer()
            return self._tokenizer

    @property
    def role_renderer(self) -> RoleRenderer:
        """Renders system/user/assistant segments with the model's chat template."""
        tokenizer = self.tokenizer
        with self._lock:
            if self._renderer is None:
                self._renderer = RoleRenderer(tokenizer, self._chat_template)
            return self._renderer

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as the runtime's /generate tokenizes it (special tokens added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def auto_bos_ids(self) -> list[int]:
        """[bos id] when tokenization prepends a BOS token, else []."""
        tok = self.tokenizer
        ids = self.encode("")
        bos = getattr(tok, "bos_token_id", None)
        return [bos] if bos is not None and ids[:1] == [bos] else []
