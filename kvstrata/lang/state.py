"""ProgramState (the `s` a program appends to) and ProgramStateGroup (the branches of `s.fork(n)`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any, Optional

from kvstrata.lang.interpreter import StreamExecutor
from kvstrata.lang.ir import as_expr


class ProgramState:
    """The state of one running program: its text, chat messages and named variables."""

    def __init__(self, executor: StreamExecutor):
        self._executor = executor
        self.ret_value: Any = None          # what the program function returned

    def __iadd__(self, other: Any) -> ProgramState:
        self._executor.submit(as_expr(other))
        return self

    def text(self) -> str:
        """The whole text so far (waits for queued expressions; raises ProgramError if the program failed)."""
        self._executor.sync()
        self._executor.check()
        return self._executor.text

    def messages(self) -> list[dict[str, str]]:
        """The chat messages so far: [{"role", "content"}, ...]."""
        self._executor.sync()
        self._executor.check()
        return [dict(m) for m in self._executor.messages]

    def __getitem__(self, name: str) -> Any:
        return self._executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self._executor.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self._executor.sync()
        return name in self._executor.variables

    def get_var(self, name: str) -> Any:
        """The value of a variable set by `gen`/`select` (waits until it is set)."""
        return self._executor.get_var(name)

    def variables(self) -> dict[str, Any]:
        """All variables set so far (a copy)."""
        self._executor.sync()
        self._executor.check()
        return dict(self._executor.variables)

    def set_var(self, name: str, value: Any) -> None:
        """Set a variable by hand."""
        self._executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """The runtime's meta_info for the call that set `name` (select: choice scores and logprobs)."""
        return self._executor.get_meta_info(name)

    def fork(self, size: int = 1) -> ProgramStateGroup:
        """`size` branches that continue from the current text; their shared prefix is pre-cached."""
        return ProgramStateGroup([ProgramState(e) for e in self._executor.fork(size)], self)

    def text_iter(self, var_name: Optional[str] = None) -> Iterator[str]:
        """Text pieces as they are produced (with `run(stream=True)`); only variable `var_name`'s if given."""
        if not self._executor.stream:
            yield self[var_name] if var_name is not None else self.text()
            return
        yield from self._executor.iter_events(var_name)

    async def text_async_iter(self, var_name: Optional[str] = None) -> AsyncIterator[str]:
        """`text_iter` for asyncio code: each piece is awaited in a worker thread, the event loop stays free."""
        pieces = self.text_iter(var_name)
        done = object()
        while True:
            piece = await asyncio.to_thread(next, pieces, done)
            if piece is done:
                return
            yield piece

    def sync(self) -> None:
        """Wait until everything appended so far has run."""
        self._executor.sync()

    def error(self) -> Optional[BaseException]:
        """The exception that stopped the program, or None."""
        self._executor.sync()
        return self._executor.error

    def __repr__(self) -> str:
        return f"ProgramState({self._executor.text!r})"


class ProgramStateGroup:
    """Forked branches: index them, append to all at once, and `join` them back."""

    def __init__(self, states: list[ProgramState], source: ProgramState):
        self.states = states
        self.source = source

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if isinstance(other, list):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} branches")
            for state, expr in zip(self.states, other):
                state += expr
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for the branches; new variables become lists on the source (or append their text)."""
        self.source._executor.join([s._executor for s in self.states], mode)
