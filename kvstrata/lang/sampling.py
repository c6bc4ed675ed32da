"""Sampling settings of a program: run-level defaults merged with each `gen`'s overrides."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional

from kvstrata.runtime.sampling_params import InvalidRequest, SamplingParams

# `gen(dtype=...)` becomes a regex constraint (the server then guarantees the shape of the value).
DTYPE_REGEX = {
    "int": r"-?\d+",
    "float": r"-?\d+(\.\d+)?",
    "bool": r"(True|False)",
    "str": r'"[^"\\\n]*"',
}
_DTYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str"}

# Fields that go in the request's `sampling_params`; the rest are top-level /generate fields.
_REQUEST_LEVEL = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


@dataclass(frozen=True)
class SamplingArgs:
    """Everything one generation call needs besides the prompt (SGLang's names and defaults)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    regex: Optional[str] = None
    json_schema: Optional[str] = None
    return_logprob: bool = False
    logprob_start_len: Optional[int] = None
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False

    def merge(self, overrides: dict[str, Any]) -> SamplingArgs:
        """A copy with the non-None `overrides` applied (already normalized by `normalize_overrides`)."""
        changes = {k: v for k, v in overrides.items() if v is not None}
        if changes.get("regex") is not None and self.json_schema is not None and "json_schema" not in changes:
            changes["json_schema"] = None     # a gen-level constraint replaces a run-level one
        if changes.get("json_schema") is not None and self.regex is not None and "regex" not in changes:
            changes["regex"] = None
        return dataclasses.replace(self, **changes)

    def sampling_params(self) -> dict[str, Any]:
        """The `sampling_params` object of a /generate request."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens, "min_new_tokens": self.min_new_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty, "ignore_eos": self.ignore_eos,
        }
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.regex is not None:
            out["regex"] = self.regex
        if self.json_schema is not None:
            out["json_schema"] = self.json_schema
        return out

    def logprob_args(self) -> dict[str, Any]:
        """The top-level logprob fields of a /generate request (empty when logprobs are not wanted)."""
        if not self.return_logprob:
            return {}
        out: dict[str, Any] = {"return_logprob": True, "top_logprobs_num": self.top_logprobs_num,
                               "return_text_in_logprobs": self.return_text_in_logprobs}
        if self.logprob_start_len is not None:
            out["logprob_start_len"] = self.logprob_start_len
        return out

    def validate(self) -> None:
        """Raise ValueError naming the first bad field (the same checks the server makes)."""
        SamplingParams.from_dict(self.sampling_params())


def normalize_overrides(**kwargs: Any) -> dict[str, Any]:
    """Check and normalize gen/run keyword arguments; drop the ones left at None.

    `max_tokens`/`min_tokens` map to `max_new_tokens`/`min_new_tokens`, `stop` becomes a tuple,
    `json_schema` a JSON string, `dtype` a regex. Raises ValueError/TypeError naming the argument.
    """
    out: dict[str, Any] = {}
    renames = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
    dtype = kwargs.pop("dtype", None)
    for key, value in kwargs.items():
        if value is None:
            continue
        key = renames.get(key, key)
        if key in ("stop", "stop_token_ids"):
            value = _as_tuple(key, value)
        elif key == "json_schema":
            value = _schema_text(value)
        elif key not in _REQUEST_LEVEL and key not in _FIELD_NAMES:
            raise TypeError(f"unknown sampling argument {key!r}")
        out[key] = value
    if dtype is not None:
        if out.get("regex") is not None or out.get("json_schema") is not None:
            raise ValueError("give at most one of dtype, regex and json_schema")
        out["regex"] = dtype_regex(dtype)
    if out.get("regex") is not None and out.get("json_schema") is not None:
        raise ValueError("give at most one of regex and json_schema")
    _check_fields(out)
    return out


def dtype_regex(dtype: Any) -> str:
    """The regex that constrains a value of `dtype` (int, float, bool, str or their names)."""
    name = _DTYPE_NAMES.get(dtype, dtype)
    if not isinstance(name, str) or name not in DTYPE_REGEX:
        raise ValueError(f"dtype must be one of int, float, bool, str; got {dtype!r}")
    return DTYPE_REGEX[name]


_FIELD_NAMES = {f.name for f in dataclasses.fields(SamplingArgs)}


def _as_tuple(key: str, value: Any) -> tuple:
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{key} must be a string/int or a list of them, got {type(value).__name__}")
    return tuple(value)


def _schema_text(value: Any) -> str:
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, str):
        try:
            json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from e
        return value
    if hasattr(value, "model_json_schema"):          # a pydantic model class
        return json.dumps(value.model_json_schema())
    raise TypeError(f"json_schema must be a dict, a JSON string or a pydantic model, got {type(value).__name__}")


def _check_fields(out: dict[str, Any]) -> None:
    """Type and range checks of each given field on its own (cross-field checks happen at run time)."""
    sampling = {k: (list(v) if isinstance(v, tuple) else v) for k, v in out.items()
                if k not in _REQUEST_LEVEL and k not in ("min_new_tokens",)}
    try:
        SamplingParams.from_dict(sampling)
    except InvalidRequest as e:
        raise ValueError(str(e)) from None
    if "min_new_tokens" in out:
        v = out["min_new_tokens"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {v!r}")
    for key in ("logprob_start_len", "top_logprobs_num"):
        v = out.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < -1):
            raise ValueError(f"{key} must be an integer, got {v!r}")
