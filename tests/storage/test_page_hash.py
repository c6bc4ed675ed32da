"""Page keys: a hash chain over full pages, namespaced, identical in every process."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstrata.cache.page_hash import namespace_root_key, page_keys, storage_namespace

NS = storage_namespace("tiny", "float32", "page_first", 4)
REPO = Path(__file__).resolve().parents[2]


def test_one_key_per_full_page_and_partial_page_ignored():
    assert page_keys(list(range(11)), 4, NS) == page_keys(list(range(8)), 4, NS)
    assert len(page_keys(list(range(11)), 4, NS)) == 2
    assert page_keys([1, 2, 3], 4, NS) == []


def test_key_is_sha256_of_previous_key_and_int32_tokens():
    tokens = [5, 70000, 2**31 - 1, 0, 9, 8, 7, 6]
    keys = page_keys(tokens, 4, NS)
    previous = hashlib.sha256(NS.encode()).hexdigest()
    for i, key in enumerate(keys):
        page = np.asarray(tokens[4 * i: 4 * i + 4], dtype="<i4").tobytes()
        assert key == hashlib.sha256(previous.encode() + page).hexdigest()
        previous = key


def test_chain_property_key_depends_on_whole_prefix():
    a = page_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, NS)
    b = page_keys([9, 2, 3, 4, 5, 6, 7, 8], 4, NS)  # same second page, different first page
    assert a[0] != b[0] and a[1] != b[1]
    longer = page_keys([1, 2, 3, 4, 5, 6, 7, 8, 1, 1, 1, 1], 4, NS)
    assert longer[:2] == a  # a shared prefix gives shared keys


def test_prior_key_continues_a_chain():
    tokens = list(range(16))
    whole = page_keys(tokens, 4, NS)
    assert page_keys(tokens[8:], 4, NS, prior_key=whole[1]) == whole[2:]
    assert page_keys(tokens[:4], 4, NS, prior_key=namespace_root_key(NS)) == whole[:1]


def test_namespaces_differ_by_every_field():
    base = ("model-a", "bfloat16", "page_first", 16)
    variants = [storage_namespace(*base), storage_namespace("model-b", *base[1:]),
                storage_namespace(base[0], "float32", *base[2:]),
                storage_namespace(*base[:2], "layer_first", base[3]),
                storage_namespace(*base[:3], 32), storage_namespace(*base, extra="salt")]
    tokens = list(range(32))
    assert len(set(variants)) == len(variants)
    assert len({page_keys(tokens, 16, ns)[0] for ns in variants}) == len(variants)
    # A separator inside a field cannot make two namespaces collide.
    assert storage_namespace("a,b", "c", "d", 1) != storage_namespace("a", "b,c", "d", 1)


def test_deterministic_across_processes():
    tokens = list(range(1000, 1040))
    code = ("from kvstrata.cache.page_hash import page_keys, storage_namespace;"
            "ns = storage_namespace('tiny', 'float32', 'page_first', 4);"
            f"print(','.join(page_keys({tokens!r}, 4, ns)))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.strip()
    assert out.split(",") == page_keys(tokens, 4, NS)


def test_invalid_arguments():
    with pytest.raises(ValueError):
        page_keys([1, 2], 0, NS)
    with pytest.raises(ValueError):
        storage_namespace("m", "float32", "page_first", 0)
    with pytest.raises(OverflowError):
        page_keys([2**40], 1, NS)
