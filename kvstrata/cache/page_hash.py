"""Page keys for the storage tier (L3): a SHA-256 hash chain over the token ids of full pages.

    key[-1] = prior_key, or sha256(namespace) for the first page of a sequence
    key[i]  = sha256(key[i-1] as ASCII  ||  page i's token ids as int32 little-endian)

A key therefore names a page *and its whole prefix*: two sequences share key i only when their first
(i+1)*page_size tokens are equal and they were hashed in the same namespace. The namespace carries
everything that changes the bytes of a page (model, dtype, KV layout, page size), so every process that
serves the same model derives the same keys, and different models never read each other's pages.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np

NAMESPACE_VERSION = "kvstrata-kv-v1"


def storage_namespace(model_identity: str, dtype: str, kv_layout: str, page_size: int, extra: str = "") -> str:
    """A namespace string naming everything that determines a page's bytes (stable across processes)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    # JSON keeps the fields unambiguous even if one contains a separator character.
    fields = [NAMESPACE_VERSION, str(model_identity), str(dtype), str(kv_layout), int(page_size), str(extra)]
    return json.dumps(fields, separators=(",", ":"))


def request_namespace(kv_namespace: str, cache_namespace: str | None) -> str:
    """The namespace a request's pages are hashed in: the engine's, narrowed by the request's cache namespace."""
    return kv_namespace if cache_namespace is None else f"{kv_namespace}|{cache_namespace}"


def namespace_root_key(namespace: str) -> str:
    """The key that precedes the first page of every sequence in `namespace`."""
    return hashlib.sha256(namespace.encode("utf-8")).hexdigest()


def page_keys(token_ids: Sequence[int], page_size: int, namespace: str, prior_key: str | None = None) -> list[str]:
    """One key per full page of `token_ids` (a trailing partial page gets none).

    `prior_key` is the key of the page just before `token_ids[0]` (to continue a chain from the middle of a
    sequence); without it the chain starts at the namespace root.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    num_pages = len(token_ids) // page_size
    if num_pages == 0:
        return []
    tokens = np.asarray(token_ids[: num_pages * page_size], dtype="<i4")
    key = prior_key if prior_key is not None else namespace_root_key(namespace)
    keys = []
    for page in tokens.reshape(num_pages, page_size):
        key = hashlib.sha256(key.encode("ascii") + page.tobytes()).hexdigest()
        keys.append(key)
    return keys
