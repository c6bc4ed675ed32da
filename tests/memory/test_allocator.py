"""PageAllocator: all-or-nothing allocation, and frees that would corrupt the free list raise."""

import random

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


def test_extend_keeps_each_sequence_in_one_run_while_they_take_turns():
    a = PageAllocator(num_pages=64, page_size=1)
    first = a.extend(None, 4, spare=8)
    second = a.extend(None, 4, spare=8)
    assert first == [1, 2, 3, 4] and second == [13, 14, 15, 16]   # past the first one's set-aside run
    assert a.free_pages == 63 - 8 and len(a.free_page_ids()) == a.free_pages   # set-aside pages count as free
    for _ in range(12):   # two decodes taking turns, one page each: neither lands in the other's run
        first += a.extend(first[-1], 1, spare=8)
        second += a.extend(second[-1], 1, spare=8)
    # The second one's run ended with free pages behind it: they were set aside for it. The first one's run
    # ended at the second one's pages: it went on in a new run past the second one's.
    assert second == list(range(13, 29))
    assert first == list(range(1, 13)) + list(range(33, 37))
    assert a.free_pages == 63 - len(first) - len(second)


def test_set_aside_pages_are_taken_back_before_an_alloc_fails_and_a_failed_extend_takes_nothing():
    a = PageAllocator(num_pages=16, page_size=1)   # 15 usable
    held = a.extend(None, 3, spare=4)              # 1-3, with 4-7 set aside
    others = a.alloc(12)                           # 8 free pages, then the set-aside run
    assert sorted(others) == list(range(4, 16)) and a.free_pages == 0
    assert a.alloc(1) is None and a.extend(held[-1], 1, spare=4) is None and a.free_pages == 0
    a.free(others[:2])
    assert a.extend(held[-1], 2, spare=4) is not None and a.free_pages == 0
    a.release_spare(3)                             # nothing set aside there any more: a no-op


def test_release_spare_gives_the_run_back_in_ascending_order():
    a = PageAllocator(num_pages=32, page_size=1)
    pages = a.extend(None, 2, spare=5)             # 1-2, 3-7 set aside
    a.release_spare(pages[-1])
    assert a.free_pages == 29 and a.alloc(3) == [3, 4, 5]
    with pytest.raises(RuntimeError, match="double free"):
        a.free([6])                                # free again, not allocated


def test_random_extends_allocs_and_frees_keep_the_accounting():
    rng = random.Random(0)
    a = PageAllocator(num_pages=200, page_size=1)
    seqs: list[list[int]] = []
    held: list[int] = []
    for _ in range(3000):
        op = rng.random()
        if op < 0.45:
            if seqs and rng.random() < 0.8:
                seq = rng.choice(seqs)
                got = a.extend(seq[-1], rng.randint(1, 3), spare=rng.choice([0, 4, 16]))
                if got is not None:
                    seq += got
            else:
                got = a.extend(None, rng.randint(1, 20), spare=16)
                if got is not None:
                    seqs.append(got)
        elif op < 0.6:
            got = a.alloc(rng.randint(1, 10))
            if got is not None:
                held += got
        elif op < 0.8 and seqs:
            seq = seqs.pop(rng.randrange(len(seqs)))
            a.release_spare(seq[-1])
            a.free(seq)
        elif held:
            rng.shuffle(held)
            a.free(held[:5])
            del held[:5]
        owned = held + [p for seq in seqs for p in seq]
        assert len(set(owned)) == len(owned) and 0 not in owned
        assert a.free_pages == 199 - len(owned) and a.free_page_ids() == set(range(1, 200)) - set(owned)
