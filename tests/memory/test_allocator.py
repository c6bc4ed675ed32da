"""PageAllocator: all-or-nothing allocation, and frees that would corrupt the free list raise."""

import pytest
import torch

from kvstrata.memory.allocator import PageAllocator


def test_alloc_is_all_or_nothing_and_free_returns_pages():
    a = PageAllocator(num_pages=6, page_size=4)   # page 0 reserved: 5 usable
    assert a.capacity_pages == 5 and a.free_tokens == 20
    first = a.alloc(3)
    assert first == [1, 2, 3]                        # low ids first
    assert a.alloc(3) is None and a.free_pages == 2   # not enough: nothing taken
    a.free(torch.tensor(first))
    assert a.free_pages == 5 and a.free_page_ids() == {1, 2, 3, 4, 5}


@pytest.mark.parametrize("bad", [[0], [-1], [6], [5], [2, 2], [3, 5]])
def test_free_of_a_reserved_free_unknown_or_repeated_page_raises_and_changes_nothing(bad):
    a = PageAllocator(num_pages=6, page_size=1)
    assert a.alloc(4) == [1, 2, 3, 4]                # page 5 stays free
    with pytest.raises(RuntimeError, match="double free or reserved page"):
        a.free(bad)
    assert a.free_page_ids() == {5}
    a.free([1])
    with pytest.raises(RuntimeError, match="double free"):
        a.free([1])
    assert a.free_page_ids() == {1, 5} and a.alloc(2) == [1, 5]
