"""Find the constant prefix of a program: the text it appends before it touches an argument or generates.

`run_batch` pre-caches that prefix once, so the batch's programs hit the prefix cache instead of all
prefilling it at the same time. The program body runs against a tracing state with placeholder
arguments; the first use of an argument (formatting, concatenation, a branch on it), the first
`gen`/`select`, or any read of the state ends the trace. Nothing is sent to the runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstrata.lang.backends.base import Backend
from kvstrata.lang.ir import Expr, ExprList, RoleBegin, RoleEnd, Text, as_expr


class _StopTracing(Exception):
    """The program reached something that depends on its arguments or on the model."""


def _stop(*_args: Any, **_kwargs: Any) -> Any:
    raise _StopTracing()


class _Placeholder:
    """Stands for an argument: any use of it stops the trace."""

    __str__ = __repr__ = __format__ = __bool__ = __len__ = __iter__ = __contains__ = _stop
    __add__ = __radd__ = __mul__ = __rmul__ = __mod__ = __getitem__ = __call__ = _stop
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __int__ = __float__ = __index__ = _stop
    __hash__ = object.__hash__

    def __getattr__(self, name: str) -> Any:
        raise _StopTracing()


class _TracingState:
    """Collects constant text and role markup; everything else stops the trace."""

    def __init__(self, backend: Backend):
        self.text = ""
        self._backend = backend
        self._messages: list[dict] = []
        self._open: tuple[str, int, str] | None = None

    def __iadd__(self, other: Any) -> _TracingState:
        self._walk(as_expr(other))
        return self

    def __getattr__(self, name: str) -> Any:      # fork, text, messages, ...: they need real results
        raise _StopTracing()

    __getitem__ = __contains__ = _stop

    def _walk(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self.text += expr.value
        elif isinstance(expr, ExprList):
            for item in expr.items:
                self._walk(item)
        elif isinstance(expr, RoleBegin) and self._open is None:
            prefix, suffix = self._backend.role_renderer.segment(expr.role, self._messages)
            self.text += prefix
            self._open = (expr.role, len(self.text), suffix)
        elif isinstance(expr, RoleEnd) and self._open is not None and self._open[0] == expr.role:
            role, start, suffix = self._open
            self._messages.append({"role": role, "content": self.text[start:]})
            self.text += suffix
            self._open = None
        else:
            raise _StopTracing()


def trace_prefix(func: Callable[..., Any], backend: Backend, arg_names: list[str]) -> str:
    """The text `func` appends before depending on any of `arg_names` or on the model ('' if none)."""
    state = _TracingState(backend)
    try:
        func(state, **{name: _Placeholder() for name in arg_names})
    except Exception:   # _StopTracing, or user code tripping over a placeholder: the prefix so far stands
        pass
    return state.text
