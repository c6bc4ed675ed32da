"""Transformers' tokenizer fingerprint of a folder, recorded once so that long-lived processes need not load it.

A LightTokenizer gives transformers' results only where AutoTokenizer builds the generic TokenizersBackend
(light_tokenizer.py). Which class it builds depends on config.json, tokenizer_config.json and tables inside
transformers, so the only sure answer is AutoTokenizer's own, and asking imports transformers' model-config
classes into the process that asks (~100 MB of RSS: torch.distributed.tensor, sympy, accelerate, hub kernels).
So a short-lived child process asks (`record_fingerprint`: server/launch.py's prepare_model_folders) and writes
the fingerprint to the cache directory, under a key of everything the answer depends on:

    the folder's real path + the contents of the files below + transformers' and tokenizers' versions

The scheduler then uses the LightTokenizer only where that record equals the LightTokenizer's own fingerprint
(tokenizer.load_checked_tokenizer), and transformers' tokenizer otherwise: no record (e.g. Engine on a folder no
server has started on), a model-specific class, or a record of another version. Torch- and transformers-free.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
from typing import Optional

from kvstrata.platform import cache_dir

logger = logging.getLogger(__name__)

RECORD_VERSION = 1     # bump when light_tokenizer.fingerprint() changes what it digests
# What AutoTokenizer reads to choose and build a tokenizer (config.json: the model type it maps to a class).
_KEYED_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
                "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")
_RECORDS_DIR = "tokenizer-fingerprints"
_READ_BYTES = 64 * 1024


def recorded_fingerprint(folder: str) -> Optional[str]:
    """The fingerprint of transformers' tokenizer of `folder` as recorded, or None when none is."""
    try:
        with open(_record_path(folder), encoding="utf-8") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def needs_record(folder: str) -> bool:
    """Whether `folder` could use the LightTokenizer but has no record to decide it by yet."""
    from kvstrata.model.light_tokenizer import LightTokenizer

    return LightTokenizer.can_load(folder) and recorded_fingerprint(folder) is None


def record_fingerprint(folder: str) -> Optional[str]:
    """Load transformers' tokenizer of `folder` (imports transformers: run in a throwaway process) and record its
    fingerprint; returns it, or None when it cannot be loaded or written (the scheduler then uses transformers)."""
    from kvstrata.model.light_tokenizer import fingerprint
    from kvstrata.model.tokenizer import TokenizerLoadError, load_tokenizer

    try:
        digest = fingerprint(load_tokenizer(folder))
        path = _record_path(folder)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as fh:
            fh.write(digest)
        os.replace(temporary, path)       # atomic: servers starting at once each write the same text
    except (TokenizerLoadError, OSError) as e:
        logger.warning("no tokenizer fingerprint recorded for %r (%s): the scheduler will load transformers' "
                       "tokenizer", folder, e)
        return None
    return digest


def _record_path(folder: str) -> str:
    return os.path.join(cache_dir(), _RECORDS_DIR, f"{_record_key(folder)}.txt")


def _record_key(folder: str) -> str:
    key = hashlib.sha256()
    versions = [str(RECORD_VERSION), _version("transformers"), _version("tokenizers"), os.path.realpath(folder)]
    key.update("\0".join(versions).encode())
    for name in _KEYED_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            key.update(f"\0{name}\0{os.path.getsize(path)}\0".encode())
            with open(path, "rb") as fh:
                # In small reads: one freed multi-MB buffer would raise glibc's mmap threshold, and the HTTP
                # process's later allocations would then stay in its heap (+11 MB of RSS measured).
                for chunk in iter(lambda: fh.read(_READ_BYTES), b""):
                    key.update(chunk)
    return key.hexdigest()[:32]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"
