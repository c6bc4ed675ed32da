"""A server whose L3 pages were damaged in the store never serves them: it drops them, counts them
`corrupt`, recomputes, and answers exactly what a server without any cache answers. Both backends:
the file backend's page files are edited on disk, the Mooncake objects are rewritten by another client."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.server.conftest import launch_server, stop_server

SAMPLING = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PAGE = 16
GROUP = 64          # tokens per L3 object (--hicache-storage-page-tokens' default)
PROMPT = [(37 * i + 11) % 900 + 5 for i in range(160)]
PROMPT_OBJECTS = len(PROMPT) // GROUP


def flip(raw: bytes) -> bytes:
    """16 bytes flipped in the middle of a page; the size stays the same."""
    return raw[:64] + bytes(b ^ 0x5A for b in raw[64:80]) + raw[80:]


def generate(server, ids: list[int]) -> dict:
    r = server.post("/generate", json={"input_ids": ids, "sampling_params": SAMPLING})
    assert r.status_code == 200, r.text
    return r.json()


def wait_until(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


class FileStore:
    """The file backend's directory: corrupt every page file in place."""

    def __init__(self, root: Path):
        self.root = root

    def flags(self) -> list[str]:
        return ["--hicache-storage-backend", "file", "--hicache-storage-dir", str(self.root)]

    def pages(self) -> list[Path]:
        return [p for p in self.root.rglob("*") if p.is_file() and not p.name.startswith(".")]

    def corrupt_all(self, server) -> int:
        wait_until(lambda: len(self.pages()) >= PROMPT_OBJECTS, "the backup of the prompt's pages")
        for path in self.pages():
            path.write_bytes(flip(path.read_bytes()))
        return len(self.pages())


class MooncakeStore:
    """A Mooncake cluster: rewrite the prompt's page objects through a client of our own."""

    def __init__(self, cluster):
        from kvstrata.storage.base import create_backend

        self.config = cluster.client_config()
        self.client = create_backend("mooncake", 4096, self.config)   # only its raw client is used

    def flags(self) -> list[str]:
        return ["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config",
                json.dumps(self.config)]

    def corrupt_all(self, server) -> int:
        keys = prompt_page_keys(server)
        store = self.client._store      # the raw Mooncake client: any writer of the cluster can do this
        wait_until(lambda: all(c == 1 for c in store.batch_is_exist(keys)), "the backup of the prompt's pages")
        for key in keys:
            raw = bytes(store.get(key))
            assert store.remove(key, True) == 0 and store.put(key, flip(raw)) == 0
        return len(keys)

    def close(self) -> None:
        self.client.close()


def prompt_page_keys(server) -> list[str]:
    """The L3 keys of the prompt's page groups, derived the way every server of this model derives them."""
    from kvstrata.cache.page_hash import page_keys, storage_namespace
    from kvstrata.cache.storage_io import model_identity
    from kvstrata.model.builtin import resolve_model_path

    dtype = server.server_info()["dtype"]
    namespace = storage_namespace(model_identity(resolve_model_path("tiny")), f"torch.{dtype}", "canonical", PAGE,
                                  extra=f"group_pages={GROUP // PAGE}")
    return page_keys(PROMPT, GROUP, namespace)


@pytest.fixture(params=["file", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def store(request, tmp_path):
    if request.param == "file":
        yield FileStore(tmp_path / "kv")
        return
    mooncake = MooncakeStore(request.getfixturevalue("own_mooncake_cluster"))
    try:
        yield mooncake
    finally:
        mooncake.close()


def test_corrupted_pages_are_recomputed_not_served(store, tmp_path):
    common = ["--page-size", str(PAGE)]     # BASE_FLAGS make outputs independent of batch shapes
    tiered = launch_server(tmp_path, *common, "--enable-hierarchical-cache", "--hicache-write-policy",
                           "write_through", *store.flags(), "--hicache-storage-prefetch-policy", "wait_complete")
    try:
        plain = launch_server(tmp_path, *common, "--disable-radix-cache")
    except BaseException:
        stop_server(tiered)
        raise
    try:
        expected = generate(plain, PROMPT)["output_ids"]
        assert generate(tiered, PROMPT)["output_ids"] == expected
        tiered.wait_idle()
        assert store.corrupt_all(tiered) >= PROMPT_OBJECTS
        assert tiered.post("/flush_cache").status_code == 200      # L1 and L2 emptied, L3 kept
        again = generate(tiered, PROMPT)
        assert again["output_ids"] == expected
        state = tiered.wait_idle()
        storage = state["hicache"]["storage"]
        assert storage["corrupt_pages"] > 0 and storage["corrupt_pages"] == storage["backend"]["corrupt"]
        assert again["meta_info"]["cached_tokens"] < PAGE, again["meta_info"]   # nothing came from bad pages
        assert state["integrity_ok"]
        assert prometheus_value(tiered.get("/metrics").text, "kvstrata:storage_corrupt_pages_total") > 0
    finally:
        stop_server(tiered)
        stop_server(plain)


def prometheus_value(text: str, name: str) -> float:
    """The value of an unlabelled sample (or the sum over its label sets) in a Prometheus exposition."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{")]
    assert values, f"{name} not in /metrics"
    return sum(values)
