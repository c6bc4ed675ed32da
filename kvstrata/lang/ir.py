"""The program IR: what `s += ...` appends (text, gen, select, role markers) and the primitives that build it.

Expressions are plain immutable values; the interpreter (`interpreter.py`) executes them against a backend.
`a + b` concatenates expressions, so `user("Q: " + question)` and `"A: " + gen("a")` both work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from kvstrata.lang.choices import ChoicesMethod, token_length_normalized
from kvstrata.lang.sampling import normalize_overrides

ROLES = ("system", "user", "assistant")


class Expr:
    """Base of everything a program can append to its state."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList((self, as_expr(other)))

    def __radd__(self, other: Any) -> ExprList:
        return ExprList((as_expr(other), self))


@dataclass(frozen=True, eq=False)
class Text(Expr):
    """Literal text appended as is."""

    value: str


@dataclass(frozen=True, eq=False)
class ExprList(Expr):
    """Expressions executed in order."""

    items: tuple[Expr, ...]

    def __add__(self, other: Any) -> ExprList:
        return ExprList((*self.items, as_expr(other)))

    def __radd__(self, other: Any) -> ExprList:
        return ExprList((as_expr(other), *self.items))


@dataclass(frozen=True, eq=False)
class Gen(Expr):
    """Generate text with the model; stored under `name` (when given) with its meta_info."""

    name: Optional[str]
    overrides: dict[str, Any]        # normalized sampling overrides (sampling.normalize_overrides)


@dataclass(frozen=True, eq=False)
class Select(Expr):
    """Append the best of `choices`, scored by prompt logprobs; stored under `name`."""

    name: Optional[str]
    choices: tuple[str, ...]
    temperature: float
    method: ChoicesMethod


@dataclass(frozen=True, eq=False)
class RoleBegin(Expr):
    """Open a chat message of `role`: appends the chat template's prefix for it."""

    role: str


@dataclass(frozen=True, eq=False)
class RoleEnd(Expr):
    """Close the open chat message of `role`: appends the template's suffix, records the message."""

    role: str


def as_expr(value: Any) -> Expr:
    """Wrap a str (or anything printable but an Expr) as Text."""
    if isinstance(value, Expr):
        return value
    if value is None:
        return ExprList(())
    if isinstance(value, (list, tuple)):
        return ExprList(tuple(as_expr(v) for v in value))
    return Text(str(value))


# ---------------------------------------------------------------------- primitives
def gen(name: Optional[str] = None, max_tokens: Optional[int] = None, min_tokens: Optional[int] = None,
        stop: Union[str, Sequence[str], None] = None, stop_token_ids: Optional[Sequence[int]] = None,
        temperature: Optional[float] = None, top_p: Optional[float] = None, top_k: Optional[int] = None,
        min_p: Optional[float] = None, frequency_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None, repetition_penalty: Optional[float] = None,
        ignore_eos: Optional[bool] = None, return_logprob: Optional[bool] = None,
        logprob_start_len: Optional[int] = None, top_logprobs_num: Optional[int] = None,
        return_text_in_logprobs: Optional[bool] = None, dtype: Any = None,
        choices: Optional[Sequence[str]] = None, choices_method: Optional[ChoicesMethod] = None,
        regex: Optional[str] = None, json_schema: Any = None) -> Expr:
    """Generate text (None means: use the run's default); with `choices`, the same as `select`."""
    _check_name(name)
    if choices is not None:
        return select(name, choices, temperature=temperature or 0.0,
                      choices_method=choices_method or token_length_normalized)
    overrides = normalize_overrides(
        max_tokens=max_tokens, min_tokens=min_tokens, stop=stop, stop_token_ids=stop_token_ids,
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, repetition_penalty=repetition_penalty, ignore_eos=ignore_eos,
        return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=dtype, regex=regex, json_schema=json_schema)
    return Gen(name, overrides)


def gen_int(name: Optional[str] = None, max_tokens: Optional[int] = None, **kwargs: Any) -> Expr:
    """Generate an integer (regex `-?\\d+`); the stored value is its text."""
    return gen(name, max_tokens=max_tokens, dtype=int, **kwargs)


def gen_string(name: Optional[str] = None, max_tokens: Optional[int] = None, **kwargs: Any) -> Expr:
    """Generate a double-quoted string on one line; the stored value is its text (quotes included)."""
    return gen(name, max_tokens=max_tokens, dtype=str, **kwargs)


def select(name: Optional[str] = None, choices: Optional[Sequence[str]] = None, temperature: float = 0.0,
           choices_method: ChoicesMethod = token_length_normalized) -> Expr:
    """Append the choice the model scores best (token-length-normalized prompt logprob by default)."""
    _check_name(name)
    if isinstance(choices, str) or not isinstance(choices, Sequence) or not choices:
        raise ValueError(f"select needs a non-empty list of strings as choices, got {choices!r}")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"select choices must be non-empty strings, got {list(choices)!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"select temperature must be a number >= 0, got {temperature!r}")
    if not isinstance(choices_method, ChoicesMethod):
        raise TypeError(f"choices_method must be one of kvstrata.lang's choices methods, got {choices_method!r}")
    return Select(name, tuple(choices), float(temperature), choices_method)


def _role(role: str, expr: Any) -> Expr:
    return ExprList((RoleBegin(role), as_expr(expr), RoleEnd(role)))


def system(expr: Any = None) -> Expr:
    """A system message whose content is `expr`."""
    return _role("system", expr)


def user(expr: Any = None) -> Expr:
    """A user message whose content is `expr`."""
    return _role("user", expr)


def assistant(expr: Any = None) -> Expr:
    """An assistant message whose content is `expr` (typically a `gen`)."""
    return _role("assistant", expr)


def system_begin() -> Expr:
    """Open a system message (close it with `system_end()`)."""
    return RoleBegin("system")


def system_end() -> Expr:
    """Close the open system message."""
    return RoleEnd("system")


def user_begin() -> Expr:
    """Open a user message (close it with `user_end()`)."""
    return RoleBegin("user")


def user_end() -> Expr:
    """Close the open user message."""
    return RoleEnd("user")


def assistant_begin() -> Expr:
    """Open an assistant message (close it with `assistant_end()`)."""
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    """Close the open assistant message."""
    return RoleEnd("assistant")


def _check_name(name: Any) -> None:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"the variable name must be a string, got {type(name).__name__}")
