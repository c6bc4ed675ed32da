"""Slot accounting across owners: every allocatable device page has exactly one owner at any time.

The owners are the allocator's free list, the radix tree (cached prefixes) and running requests (their
private, not yet cached pages). A page with no owner is leaked; a page with two is about to be corrupted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvstrata.memory.allocator import PageAllocator

if TYPE_CHECKING:
    from kvstrata.cache.device_tier import DeviceTier

_SHOWN = 16  # page ids listed per problem in the error message


def check_slot_accounting(allocator: PageAllocator, cache: DeviceTier | None,
                          running_pages: Iterable[int]) -> None:
    """Raise AssertionError naming leaked or double-owned pages among {free list, tree, running requests}."""
    free_ids = allocator.free_page_ids()
    problems = []
    if allocator.free_pages != len(free_ids):
        problems.append(f"free list holds {allocator.free_pages - len(free_ids)} duplicate entries")
    owners: dict[str, Counter] = {"free": Counter(free_ids), "running": Counter(int(p) for p in running_pages)}
    if cache is not None:
        tree_pages = cache.owned_pages()
        owners["tree"] = Counter(tree_pages)
        tree_tokens = len(tree_pages) * allocator.page_size
        if tree_tokens != cache.total_size():
            problems.append(f"tree holds {len(tree_pages)} distinct pages but counts {cache.total_size()} tokens")
    allocatable = range(allocator.reserved_pages, allocator.num_pages)
    count = Counter()
    for counter in owners.values():
        count.update(counter)
    leaked = [p for p in allocatable if count[p] == 0]
    double = [p for p in allocatable if count[p] > 1]
    foreign = sorted(p for p in count if p not in allocatable)
    if leaked:
        problems.append(f"{len(leaked)} leaked pages (no owner): {leaked[:_SHOWN]}")
    if double:
        detail = [f"{p}<-{'+'.join(f'{name}x{c[p]}' for name, c in owners.items() if c[p])}"
                  for p in double[:_SHOWN]]
        problems.append(f"{len(double)} pages with several owners: {detail}")
    if foreign:
        problems.append(f"pages outside the allocatable range {allocatable}: {foreign[:_SHOWN]}")
    if problems:
        raise AssertionError("slot accounting: " + "; ".join(problems))
