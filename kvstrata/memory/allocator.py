"""PageAllocator: hands out the free pages of one tier; slots_for_extend maps new tokens to slots.

A request's KV lives in whole pages; only its last page may be partly filled. Page 0 is reserved
(see DeviceKVPool), so page ids handed out are 1..num_pages-1.
"""

from __future__ import annotations

import torch


class PageAllocator:
    """Free list of page ids. `alloc` is all-or-nothing; `free` of a page not allocated raises."""

    def __init__(self, num_pages: int, page_size: int, reserved_pages: int = 1):
        self.num_pages = num_pages
        self.page_size = page_size
        self.reserved_pages = reserved_pages
        self._free: list[int] = list(range(num_pages - 1, reserved_pages - 1, -1))  # pop() gives low ids
        # One byte per page, in Python: with page size 1 every decode token allocates a page, and indexing a
        # torch tensor with a list cost ~15 µs per call (~0.25 ms of a 16-stream step).
        self._is_free = bytearray(reserved_pages) + bytearray(b"\x01") * (num_pages - reserved_pages)

    @property
    def capacity_pages(self) -> int:
        """Pages that can ever be allocated."""
        return self.num_pages - self.reserved_pages

    @property
    def free_pages(self) -> int:
        """Pages available now."""
        return len(self._free)

    @property
    def free_tokens(self) -> int:
        """Tokens available now (free pages × page size)."""
        return len(self._free) * self.page_size

    def can_alloc(self, num_pages: int) -> bool:
        """Whether `alloc(num_pages)` would succeed."""
        return num_pages <= len(self._free)

    def alloc(self, num_pages: int) -> list[int] | None:
        """Take `num_pages` pages, or None (and take nothing) when there are not enough."""
        if num_pages > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(num_pages)]
        for page in pages:
            self._is_free[page] = 0
        return pages

    def free(self, pages: list[int] | torch.Tensor) -> None:
        """Return pages to the free list; freeing a free or reserved page is a bug and raises."""
        if isinstance(pages, torch.Tensor):
            pages = pages.tolist()
        if not pages:
            return
        is_free = self._is_free
        if (any(not self.reserved_pages <= p < self.num_pages or is_free[p] for p in pages)
                or len(set(pages)) != len(pages)):
            raise RuntimeError(f"double free or reserved page in free(): {pages[:16]}")
        for page in pages:
            is_free[page] = 1
        self._free.extend(pages)

    def free_page_ids(self) -> set[int]:
        """The set of free page ids (for integrity checks)."""
        return set(self._free)


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
                     page_size: int) -> torch.Tensor:
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
    return torch.tensor(out, dtype=torch.long)
