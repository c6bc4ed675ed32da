"""PrefixTree: the router's approximate record of the prompts it sent to one worker.

A radix tree over sequences (a tuple of token ids, or a str of characters): `insert` records a prompt,
`match` returns how much of a prompt was recorded before, `evict` drops least-recently-used leaves
until at most `max_size` entries remain. It does no I/O and knows nothing of workers; it approximates the
worker's own cache (which evicts on its own schedule), so a match is a hint, never a promise.

    size = number of sequence elements stored on all edges
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Optional


class _Node:
    __slots__ = ("key", "children", "parent", "last_access")

    def __init__(self, key: Sequence, parent: Optional[_Node], last_access: int):
        self.key = key
        self.children: dict = {}
        self.parent = parent
        self.last_access = last_access


class PrefixTree:
    """Radix tree of sequences with LRU leaf eviction."""

    def __init__(self) -> None:
        self._clock = itertools.count(1)
        self.root = _Node((), None, 0)
        self.size = 0

    def match(self, key: Sequence) -> int:
        """Length of the longest recorded prefix of `key`; marks the matched nodes as used."""
        node, matched, now = self.root, 0, next(self._clock)
        while matched < len(key):
            child = node.children.get(key[matched])
            if child is None:
                break
            n = _common_length(child.key, key, matched)
            child.last_access = now
            matched += n
            if n < len(child.key):
                break
            node = child
        return matched

    def insert(self, key: Sequence) -> None:
        """Record `key` (splitting an edge where it diverges)."""
        node, pos, now = self.root, 0, next(self._clock)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                node.children[key[pos]] = _Node(key[pos:], node, now)
                self.size += len(key) - pos
                return
            n = _common_length(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n

    def evict(self, max_size: int) -> int:
        """Drop least-recently-used leaves until size <= max_size; returns the entries removed."""
        if self.size <= max_size:
            return 0
        before = self.size
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        while heap and self.size > max_size:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self.size -= len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return before - self.size

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut `child`'s edge after n elements; returns the new upper node."""
        upper = _Node(child.key[:n], child.parent, child.last_access)
        child.parent.children[child.key[0]] = upper
        child.key = child.key[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out


def _common_length(edge: Sequence, key: Sequence, start: int) -> int:
    """How many leading elements of `edge` equal key[start:]."""
    n = min(len(edge), len(key) - start)
    if key[start:start + n] == edge[:n]:   # the common case, compared in C
        return n
    i = 0
    while i < n and edge[i] == key[start + i]:
        i += 1
    return i
