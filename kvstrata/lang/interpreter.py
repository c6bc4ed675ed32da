"""StreamExecutor: runs one program state's expressions in order, in a worker thread, against a backend.

The program body (user code) only queues expressions (`s += ...`); a worker thread executes them, so
forked branches generate concurrently. The worker starts when something is queued and exits when the
queue is empty, so no thread outlives its work. Reading a variable waits until the expression that sets
it has run; the first failure is kept, the rest of the queue is skipped, and every reader gets a
ProgramError naming it: nothing waits forever on a failed program.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

from kvstrata.lang.backends.base import Backend, GenOutput
from kvstrata.lang.ir import Expr, ExprList, Gen, RoleBegin, RoleEnd, Select, Text
from kvstrata.lang.sampling import SamplingArgs
from kvstrata.lang.scoring import select_choice

_REPLACEMENT = "\ufffd"


class ProgramError(RuntimeError):
    """A program failed; the message names the problem (its cause is chained)."""


@dataclass(frozen=True, eq=False)
class _CommitPrefix(Expr):
    """Pre-cache the text so far (before a fork), so that the branches' requests hit the prefix cache."""


@dataclass(frozen=True, eq=False)
class _Splice(Expr):
    """Append text and the messages it contains (joined branches)."""

    text: str
    messages: tuple


@dataclass(frozen=True, eq=False)
class _End(Expr):
    """The program body has returned: streaming readers stop after this."""


@dataclass
class StreamEvent:
    """A piece of text appended to the state; `name` is the variable it belongs to, if any."""

    name: Optional[str]
    delta: str


class StreamExecutor:
    """The text, messages and variables of one program state, and the worker that grows them."""

    def __init__(self, backend: Backend, defaults: SamplingArgs, stream: bool = False):
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.text = ""
        self.messages: list[dict[str, str]] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.error: Optional[BaseException] = None
        self._role: Optional[tuple[str, int, str]] = None   # (open role, content start, its suffix)
        self._fork_point: tuple[int, int, frozenset] = (0, 0, frozenset())   # text len, messages, variables
        self._queue: deque[Expr] = deque()
        self._pending = 0                     # queued or running expressions
        self._unset: dict[str, int] = {}      # variable -> queued expressions that will set it
        self._worker_running = False
        self._finished = False
        self._events: list[StreamEvent] = []
        self._cond = threading.Condition()
        self.body_thread: Optional[threading.Thread] = None   # set by run(stream=True): the body's thread

    # ------------------------------------------------------------------ queueing and waiting
    def submit(self, expr: Expr) -> None:
        """Queue `expr`; the worker thread runs it after what is already queued."""
        with self._cond:
            self._queue.append(expr)
            self._pending += 1
            for name in _names(expr):
                self._unset[name] = self._unset.get(name, 0) + 1
            if not self._worker_running:
                self._worker_running = True
                threading.Thread(target=self._work, name="kvstrata-lang-executor", daemon=True).start()

    def end(self) -> None:
        """Mark the end of the program body."""
        self.submit(_End())

    def fail(self, error: BaseException) -> None:
        """Record a failure of the program body itself."""
        with self._cond:
            if self.error is None:
                self.error = error
            self._cond.notify_all()

    def sync(self) -> None:
        """Wait until every queued expression has run (and, from outside a streamed body, until it ends)."""
        with self._cond:
            while self._pending or self._body_running():
                self._cond.wait()

    def _body_running(self) -> bool:
        """A streamed program body is still queueing, and the caller is not that body (which would deadlock)."""
        body = self.body_thread
        return body is not None and not self._finished and threading.current_thread() is not body

    def check(self) -> None:
        """Raise ProgramError if the program failed."""
        if self.error is not None:
            raise ProgramError(f"the program failed: {type(self.error).__name__}: {self.error}") from self.error

    def get_var(self, name: str) -> Any:
        """The value of variable `name`, once the expression that sets it has run."""
        with self._cond:
            while (self._unset.get(name) or (name not in self.variables and self._body_running())) \
                    and self.error is None:
                self._cond.wait()
            if name in self.variables:
                return self.variables[name]
        self.check()
        raise KeyError(f"no variable {name!r} in this program state (variables: {sorted(self.variables)})")

    def get_meta_info(self, name: str) -> Any:
        """The meta_info of the call that set variable `name`."""
        self.get_var(name)
        return self.meta_info.get(name)

    def set_var(self, name: str, value: Any) -> None:
        """Set a variable directly (after what is queued has run)."""
        self.sync()
        with self._cond:
            self.variables[name] = value

    # ------------------------------------------------------------------ fork and join
    def fork(self, size: int) -> list[StreamExecutor]:
        """`size` copies of this state; a non-trivial prefix is pre-cached first so that branches share it."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"fork size must be an integer >= 1, got {size!r}")
        if size > 1:
            self.submit(_CommitPrefix())
        self.sync()
        self.check()
        children = []
        with self._cond:
            for _ in range(size):
                child = StreamExecutor(self.backend, self.defaults, self.stream)
                child.text, child.messages = self.text, [dict(m) for m in self.messages]
                child.variables, child.meta_info = dict(self.variables), dict(self.meta_info)
                child._role = self._role
                child._fork_point = (len(self.text), len(self.messages), frozenset(self.variables))
                children.append(child)
        return children

    def join(self, children: list[StreamExecutor], mode: str = "gather_variable") -> None:
        """Bring branches back: gather their new variables as lists, or append their new text in order."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
        for child in children:
            child.sync()
            child.check()
        if mode == "concate_and_append":
            for child in children:
                text_at, msgs_at, _ = child._fork_point
                self.submit(_Splice(child.text[text_at:], tuple(child.messages[msgs_at:])))
            return
        self.sync()
        with self._cond:
            for child in children:
                for name in child.variables:
                    if name in child._fork_point[2]:
                        continue
                    if not isinstance(self.variables.get(name), list):
                        self.variables[name], self.meta_info[name] = [], []
                    self.variables[name].append(child.variables[name])
                    self.meta_info[name].append(child.meta_info.get(name))

    # ------------------------------------------------------------------ streaming
    def iter_events(self, var_name: Optional[str] = None) -> Iterator[str]:
        """Text deltas as they are appended (of one variable, or all), until the program (or variable) ends."""
        seen = 0
        while True:
            with self._cond:
                while seen >= len(self._events) and not self._iter_done(var_name):
                    self._cond.wait()
                batch, seen = self._events[seen:], len(self._events)
                done = self._iter_done(var_name)
            for event in batch:
                if var_name is None or event.name == var_name:
                    yield event.delta
            if done:
                with self._cond:
                    if seen >= len(self._events):
                        break
        self.check()

    def _iter_done(self, var_name: Optional[str]) -> bool:
        if self.error is not None or self._finished:
            return True
        if self.body_thread is None and not self._pending:
            return True      # a forked branch has no body to wait for: it is done when its queue is empty
        return var_name is not None and var_name in self.variables and not self._unset.get(var_name)

    # ------------------------------------------------------------------ the worker
    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._worker_running = False
                    self._cond.notify_all()
                    return
                expr = self._queue.popleft()
            try:
                if isinstance(expr, _End):
                    with self._cond:
                        self._finished = True
                elif self.error is None:
                    self._execute(expr)
            except BaseException as e:        # kept for readers; the worker itself must not die silently
                self.fail(e)
            finally:
                with self._cond:
                    self._pending -= 1
                    for name in _names(expr):
                        self._unset[name] -= 1
                    self._cond.notify_all()

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self._append(expr.value)
        elif isinstance(expr, ExprList):
            for item in expr.items:
                self._execute(item)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, _CommitPrefix):
            if self.text:
                self.backend.cache_prefix(self.text)
        elif isinstance(expr, _Splice):
            self._append(expr.text)
            self.messages.extend(dict(m) for m in expr.messages)
        else:
            raise TypeError(f"cannot append {type(expr).__name__} to a program state")

    def _append(self, text: str, name: Optional[str] = None) -> None:
        with self._cond:
            self.text += text
            if self.stream and text:
                self._events.append(StreamEvent(name, text))
                self._cond.notify_all()

    def _set(self, name: Optional[str], value: Any, meta: Any) -> None:
        if name is not None:
            with self._cond:
                self.variables[name] = value
                self.meta_info[name] = meta

    def _gen(self, expr: Gen) -> None:
        args = self.defaults.merge(expr.overrides)
        args.validate()
        prompt = self.text
        out = self._stream_gen(prompt, args, expr.name) if self.stream else self.backend.generate(prompt, args)
        if not self.stream:
            self._append(out.text, expr.name)
        self._set(expr.name, out.text, out.meta_info)

    def _stream_gen(self, prompt: str, args: SamplingArgs, name: Optional[str]) -> GenOutput:
        sent = ""
        last = GenOutput("", {})
        for last in self.backend.generate_stream(prompt, args):
            visible = last.text
            if last.meta_info.get("finish_reason") is None:
                # A trailing U+FFFD may be half a character whose other bytes are still to come.
                visible = visible.rstrip(_REPLACEMENT)
            if visible.startswith(sent):
                self._append(visible[len(sent):], name)
            else:                             # the runtime revised text it had sent (e.g. a trimmed stop)
                with self._cond:
                    self.text = prompt + visible
            sent = visible
        if sent != last.text:
            with self._cond:
                self.text = prompt + last.text
        return last

    def _select(self, expr: Select) -> None:
        chosen = select_choice(self.backend, self.text, expr.choices, expr.method, expr.temperature)
        self._append(chosen.choice, expr.name)
        self._set(expr.name, chosen.choice, chosen.meta_info)

    def _role_begin(self, role: str) -> None:
        if self._role is not None:
            raise ProgramError(f"cannot begin a {role!r} message: the {self._role[0]!r} message is still open")
        prefix, suffix = self.backend.role_renderer.segment(role, self.messages)
        self._append(prefix)
        self._role = (role, len(self.text), suffix)

    def _role_end(self, role: str) -> None:
        if self._role is None or self._role[0] != role:
            opened = f"the open message is {self._role[0]!r}" if self._role else "no message is open"
            raise ProgramError(f"cannot end a {role!r} message: {opened}")
        _, start, suffix = self._role
        self.messages.append({"role": role, "content": self.text[start:]})
        self._append(suffix)
        self._role = None


def _names(expr: Expr) -> list[str]:
    """Variables an expression sets."""
    if isinstance(expr, (Gen, Select)):
        return [expr.name] if expr.name is not None else []
    if isinstance(expr, ExprList):
        return [n for item in expr.items for n in _names(item)]
    return []
