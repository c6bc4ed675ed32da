"""Page checksums: every stored page carries a digest of its bytes bound to its key, checked on load.

    stored object = page bytes (page_bytes)  ||  trailer (TRAILER_BYTES)
    trailer       = XXH3-128( MAGIC || len(key) as 2 bytes || key as UTF-8 || page bytes )

What this catches: bit rot, truncation, a torn or partial write, a page zero-filled or overwritten by
a buggy tool, a page copied or renamed to another key (the key is inside the digest, so a valid page of
key A stored under key B fails), and pages of an older format (their size differs).
What it does not: it is not authentication. The scheme is public and unkeyed, so anyone who can write
the store can compute a matching trailer for bytes of their choice; tenants that must not trust each
other need separate stores or namespaces (`cache_salt`, a different storage dir / Mooncake cluster).

Why XXH3 and not SHA-256: the checksum guards against accidents, not adversaries (see above), and it
runs on the storage thread that shares the cores with the model. XXH3-128 hashes 20-40 GB/s where
SHA-256 (with the CPU's SHA extensions) does ~1.6 GB/s (docs/benchmarks.md, issue 19's nineteenth round);
a 128-bit digest misses a random corruption with probability 2^-128. Page keys, which name content across processes, stay a SHA-256 chain (page_hash.py).
"""

from __future__ import annotations

import xxhash

TRAILER_BYTES = 16        # one XXH3-128 digest
MAGIC = b"kvstrata-page-v2"


def page_digest(key: str, page: memoryview | bytes) -> bytes:
    """The trailer that `page` must carry when stored under `key`."""
    key_bytes = key.encode("utf-8")
    h = xxhash.xxh3_128()
    h.update(MAGIC)
    h.update(len(key_bytes).to_bytes(2, "little"))
    h.update(key_bytes)
    h.update(page)
    return h.digest()


def page_is_intact(key: str, page: memoryview | bytes, trailer: memoryview | bytes) -> bool:
    """Whether `trailer` is the digest of `page` under `key`."""
    return bytes(trailer) == page_digest(key, page)
