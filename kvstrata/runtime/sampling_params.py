"""SamplingParams: SGLang's sampling fields, normalized and validated once when a request arrives."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Optional


class InvalidRequest(ValueError):
    """A request the client got wrong; the message names the field. Servers answer it with HTTP 400."""


_INT_FIELDS = {"max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed"}
_FLOAT_FIELDS = {"temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty"}
_BOOL_FIELDS = {"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}


@dataclass
class SamplingParams:
    """Per-request sampling settings (SGLang field names and defaults)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: Optional[str] = None
    json_schema: Optional[str] = None
    ebnf: Optional[str] = None
    sampling_seed: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None   # token id -> added to its logit (OpenAI: [-100, 100])

    @staticmethod
    def from_dict(d: Optional[dict[str, Any]]) -> SamplingParams:
        """Build from a client's JSON dict: null means default, types checked, unknown keys rejected (as SGLang
        does: a parameter we would silently ignore is worse than a 400)."""
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise InvalidRequest(f"sampling_params must be an object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if value is None or _is_neutral_extra(key, value):
                continue
            if key not in known:
                raise InvalidRequest(f"unknown or unsupported sampling parameter {key!r}")
            kwargs[key] = _coerce(key, value)
        params = SamplingParams(**kwargs)
        params.verify()
        return params

    @property
    def is_greedy(self) -> bool:
        """Temperature 0 (or top_k 1) means argmax."""
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def constraint(self) -> Optional[tuple[str, str]]:
        """(kind, text) of the grammar constraint, if any."""
        for kind in ("regex", "json_schema", "ebnf"):
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return None

    def verify(self, vocab_size: Optional[int] = None) -> None:
        """Raise InvalidRequest naming the first out-of-range field."""
        if self.max_new_tokens < 0:
            raise InvalidRequest(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise InvalidRequest(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidRequest(f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                                 f"({self.max_new_tokens})")
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 2:
            raise InvalidRequest(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.sampling_seed is not None and not 0 <= self.sampling_seed < 2**63:
            raise InvalidRequest(f"sampling_seed must be in [0, 2**63), got {self.sampling_seed}")
        if self.n < 1 or self.n > 128:
            raise InvalidRequest(f"n must be in [1, 128], got {self.n}")
        if sum(x is not None for x in (self.regex, self.json_schema, self.ebnf)) > 1:
            raise InvalidRequest("only one of regex, json_schema and ebnf may be set")
        for pattern in self.stop_regex:
            try:
                re.compile(pattern)
            except re.error as e:
                raise InvalidRequest(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from e
        if vocab_size is not None:
            bad_bias = [t for t in self.logit_bias or {} if not 0 <= t < vocab_size]
            if bad_bias:
                raise InvalidRequest(f"logit_bias token ids out of vocabulary range [0, {vocab_size}): "
                                     f"{bad_bias[:5]}")
            if self.top_k >= vocab_size:
                self.top_k = -1             # keeping every token is what top_k >= vocab means
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequest(f"stop_token_ids out of vocabulary range [0, {vocab_size}): {bad[:5]}")


def _coerce(key: str, value: Any) -> Any:
    if key in _BOOL_FIELDS:
        if not isinstance(value, bool):
            raise InvalidRequest(f"{key} must be a boolean, got {value!r}")
        return value
    if key in _INT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise InvalidRequest(f"{key} must be an integer, got {value!r}")
        return int(value)
    if key in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequest(f"{key} must be a number, got {value!r}")
        return float(value)
    if key in ("stop", "stop_regex"):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise InvalidRequest(f"{key} must be a string or a list of strings")
        if any(s == "" for s in value):
            raise InvalidRequest(f"{key} must not contain empty strings")
        return value
    if key == "stop_token_ids":
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                  for t in value):
            raise InvalidRequest("stop_token_ids must be a list of integers")
        return value
    if key == "logit_bias":
        return _logit_bias(value)
    if key == "json_schema" and isinstance(value, (dict, bool)):
        import json
        return json.dumps(value)
    if key in ("regex", "json_schema", "ebnf"):
        if not isinstance(value, str):
            raise InvalidRequest(f"{key} must be a string")
        return value
    return value


MAX_LOGIT_BIAS = 100.0
# SGLang sampling parameters we have no use for, accepted only with the value that changes nothing.
_NEUTRAL_EXTRAS = {"stream_interval": (1,), "custom_params": ({},), "structural_tag": ("",)}


def _is_neutral_extra(key: str, value: Any) -> bool:
    return key in _NEUTRAL_EXTRAS and value in _NEUTRAL_EXTRAS[key]


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]} (keys as strings or integers)."""
    if not isinstance(value, dict):
        raise InvalidRequest("logit_bias must be an object mapping token ids to biases")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            token = int(key)
        if token is None:
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}")
        number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
        if not number or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias[{key!r}] must be a number in [-100, 100], got {bias!r}")
        out[token] = float(bias)
    return out
