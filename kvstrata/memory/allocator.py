"""PageAllocator: hands out the free pages of one tier; slots_for_extend maps new tokens to slots.

A request's KV lives in whole pages; only its last page may be partly filled. Page 0 is reserved
(see DeviceKVPool), so page ids handed out are 1..num_pages-1.
"""

from __future__ import annotations

import torch

# Page states in PageAllocator._state.
_USED, _FREE, _SET_ASIDE = 0, 1, 2


class PageAllocator:
    """Free pages of one tier. `alloc` is all-or-nothing; `free` of a page not allocated raises.

    `extend` places a sequence's new pages right after its last one where it can, and sets a few more free
    pages aside behind them for its next tokens. With page size 1, concurrent decodes that each took the
    next free slot would interleave their keys `streams` slots apart, and the attention kernels read
    scattered keys ~1.8x slower than runs of them (docs/benchmarks.md, twelfth round). A page set aside
    still counts as free: `alloc` takes truly free pages first and then reclaims set-aside runs, so the
    runs never cost an eviction, an admission or a page of capacity.
    """

    def __init__(self, num_pages: int, page_size: int, reserved_pages: int = 1):
        self.num_pages = num_pages
        self.page_size = page_size
        self.reserved_pages = reserved_pages
        # A stack of free page ids (pop() gives low ids first). Pages that `extend` took or set aside from
        # the middle stay in it as stale entries, skipped when popped (their state is no longer free).
        self._free: list[int] = list(range(num_pages - 1, reserved_pages - 1, -1))
        # One byte per page, in Python: with page size 1 every decode token allocates a page, and indexing a
        # torch tensor with a list cost ~15 µs per call (~0.25 ms of a 16-stream step).
        self._state = bytearray(reserved_pages) + bytearray([_FREE]) * (num_pages - reserved_pages)
        self._num_free = num_pages - reserved_pages
        self._set_aside: dict[int, int] = {}   # first page -> end of a run kept for the page before it
        self._num_set_aside = 0
        self._cursor = reserved_pages          # where the next search for a free run starts
        self._missed_run = num_pages           # no free run this long exists (until pages are freed)

    @property
    def capacity_pages(self) -> int:
        """Pages that can ever be allocated."""
        return self.num_pages - self.reserved_pages

    @property
    def free_pages(self) -> int:
        """Pages available now without evicting anything (set-aside runs included)."""
        return self._num_free + self._num_set_aside

    @property
    def free_tokens(self) -> int:
        """Tokens available now (free pages × page size)."""
        return self.free_pages * self.page_size

    def can_alloc(self, num_pages: int) -> bool:
        """Whether `alloc(num_pages)` would succeed."""
        return num_pages <= self.free_pages

    def alloc(self, num_pages: int) -> list[int] | None:
        """Take `num_pages` pages, or None (and take nothing) when there are not enough."""
        if num_pages > self.free_pages:
            return None
        while self._num_free < num_pages:     # the oldest set-aside runs go back first
            self._release_run(next(iter(self._set_aside)))
        pages = []
        state, free = self._state, self._free
        while len(pages) < num_pages:
            page = free.pop()
            if state[page] == _FREE:
                state[page] = _USED
                pages.append(page)
        self._num_free -= num_pages
        return pages

    def extend(self, after: int | None, num_pages: int, spare: int = 0) -> list[int] | None:
        """`num_pages` pages for a sequence whose last page is `after` (None: a new one), or None (nothing
        taken) when there are not enough. They continue `after` in order where its set-aside run or the free
        pages behind it allow, else start a free run elsewhere; up to `spare` more free pages behind them
        are set aside for the sequence's next call."""
        if num_pages > self.free_pages:
            return None
        pages: list[int] = []
        if after is not None and num_pages:
            pages = self._take_set_aside(after + 1, num_pages)
            after = pages[-1] if pages else after
        rest = num_pages - len(pages)
        if rest:
            start = self._free_run(after, rest + spare)
            if start is None:
                start = self._free_run(after, rest)
            if start is None:
                return pages + self.alloc(rest)   # scattered: no free run that long
            run = range(start, start + rest)
            for page in run:
                self._state[page] = _USED
            self._num_free -= rest
            pages.extend(run)
        if spare and pages and pages[-1] + 1 not in self._set_aside:
            self._set_aside_behind(pages[-1], spare)
        return pages

    def release_spare(self, after: int) -> None:
        """Give back the run set aside behind page `after` (its sequence is done), if any."""
        if after + 1 in self._set_aside:
            self._release_run(after + 1)

    def free(self, pages: list[int] | torch.Tensor) -> None:
        """Return pages to the free list; freeing a free, set-aside or reserved page is a bug and raises."""
        if isinstance(pages, torch.Tensor):
            pages = pages.tolist()
        if not pages:
            return
        state = self._state
        if (any(not self.reserved_pages <= p < self.num_pages or state[p] != _USED for p in pages)
                or len(set(pages)) != len(pages)):
            raise RuntimeError(f"double free or reserved page in free(): {pages[:16]}")
        for page in pages:
            state[page] = _FREE
        self._push(pages)
        self._num_free += len(pages)

    def free_page_ids(self) -> set[int]:
        """The set of page ids available now (free or set aside), for integrity checks."""
        return {page for page, s in enumerate(self._state) if s != _USED and page >= self.reserved_pages}

    # ---- free runs ----------------------------------------------------------------------------------------

    def _free_run(self, after: int | None, length: int) -> int | None:
        """First page of `length` consecutive free pages: right behind `after` if they are free there, else
        the next such run from the search cursor on (wrapping around); None if there is none."""
        pattern = bytes([_FREE]) * length
        if after is not None and self._state.startswith(pattern, after + 1):
            return after + 1
        if length >= self._missed_run:   # a fragmented pool: no scan per token for a run that is not there
            return None
        start = self._state.find(pattern, self._cursor)
        if start < 0:
            start = self._state.find(pattern, self.reserved_pages)
        if start < 0:
            self._missed_run = length
            return None
        self._cursor = start + length
        return start

    def _take_set_aside(self, start: int, num_pages: int) -> list[int]:
        """Up to `num_pages` pages from the front of the run set aside at `start` (none if there is none)."""
        end = self._set_aside.pop(start, None)
        if end is None:
            return []
        take = min(num_pages, end - start)
        for page in range(start, start + take):
            self._state[page] = _USED
        self._num_set_aside -= take
        if start + take < end:
            self._set_aside[start + take] = end
        return list(range(start, start + take))

    def _set_aside_behind(self, last: int, spare: int) -> None:
        """Set aside the free pages right behind `last`, up to `spare` of them."""
        state, end = self._state, last + 1
        while end < min(self.num_pages, last + 1 + spare) and state[end] == _FREE:
            state[end] = _SET_ASIDE
            end += 1
        if end > last + 1:
            self._set_aside[last + 1] = end
            self._num_free -= end - last - 1
            self._num_set_aside += end - last - 1

    def _release_run(self, start: int) -> None:
        """A set-aside run back to free pages (pushed so that pop() takes them in ascending order)."""
        end = self._set_aside.pop(start)
        for page in range(start, end):
            self._state[page] = _FREE
        self._push(range(end - 1, start - 1, -1))
        self._num_free += end - start
        self._num_set_aside -= end - start

    def _push(self, pages) -> None:
        """Free pages onto the stack; rebuilt from the states when stale entries make up most of it."""
        self._missed_run = self.num_pages
        self._free.extend(pages)
        if len(self._free) > 2 * self.num_pages:
            self._free = [p for p in range(self.num_pages - 1, self.reserved_pages - 1, -1)
                          if self._state[p] == _FREE]


def pages_of_slots(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Unique page ids, in order of first appearance, that hold `slots` (slots of one request are page-ordered)."""
    if slots.numel() == 0:
        return slots.new_empty(0)
    pages = slots // page_size
    keep = torch.ones_like(pages, dtype=torch.bool)
    keep[1:] = pages[1:] != pages[:-1]
    return pages[keep]


def pages_needed(cur_len: int, new_len: int, page_size: int) -> int:
    """New pages a sequence of `cur_len` tokens needs to grow to `new_len` tokens."""
    return -(-new_len // page_size) - (-(-cur_len // page_size))


def slots_for_extend(last_slot: int | None, cur_len: int, num_new: int, new_pages: list[int],
                     page_size: int) -> list[int]:
    """Slots for `num_new` tokens appended to a sequence of `cur_len` tokens whose last slot is `last_slot`.

    The tail of the current last page is used first, then `new_pages` in order.
    """
    out: list[int] = []
    used_in_last = cur_len % page_size
    if used_in_last and last_slot is not None:
        room = min(page_size - used_in_last, num_new)
        out.extend(range(last_slot + 1, last_slot + 1 + room))
    for page in new_pages:
        if len(out) >= num_new:
            break
        take = min(page_size, num_new - len(out))
        out.extend(range(page * page_size, page * page_size + take))
    if len(out) != num_new:
        raise RuntimeError(f"slots_for_extend: {len(out)} slots for {num_new} tokens")
    return out
