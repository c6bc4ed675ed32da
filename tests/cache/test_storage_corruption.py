"""A server whose L3 pages were damaged on disk never serves them: it drops them, counts them
`corrupt`, recomputes, and answers exactly what a server without any cache answers."""

from __future__ import annotations

import time
from pathlib import Path

from tests.server.conftest import launch_server, stop_server

SAMPLING = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPT = [(37 * i + 11) % 900 + 5 for i in range(160)]
COMMON = ["--page-size", "16"]   # BASE_FLAGS make outputs independent of batch shapes


def generate(server, ids: list[int]) -> dict:
    r = server.post("/generate", json={"input_ids": ids, "sampling_params": SAMPLING})
    assert r.status_code == 200, r.text
    return r.json()


def page_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]


def wait_for_pages(root: Path, count: int, timeout: float = 60.0) -> list[Path]:
    deadline = time.monotonic() + timeout
    while len(files := page_files(root)) < count:
        assert time.monotonic() < deadline, f"only {len(files)} page files after {timeout} s"
        time.sleep(0.1)
    return files


def test_corrupted_pages_are_recomputed_not_served(tmp_path):
    store = tmp_path / "kv"
    tiered = launch_server(tmp_path, *COMMON, "--enable-hierarchical-cache", "--hicache-write-policy",
                           "write_through", "--hicache-storage-backend", "file", "--hicache-storage-dir",
                           str(store), "--hicache-storage-prefetch-policy", "wait_complete")
    try:
        plain = launch_server(tmp_path, *COMMON, "--disable-radix-cache")
    except BaseException:
        stop_server(tiered)
        raise
    try:
        expected = generate(plain, PROMPT)["output_ids"]
        assert generate(tiered, PROMPT)["output_ids"] == expected
        tiered.wait_idle()
        files = wait_for_pages(store, len(PROMPT) // 16)
        for path in files:                   # flip 16 bytes in every page file, same size
            raw = bytearray(path.read_bytes())
            raw[64:80] = bytes(b ^ 0x5A for b in raw[64:80])
            path.write_bytes(bytes(raw))
        assert tiered.post("/flush_cache").status_code == 200      # L1 and L2 emptied, L3 kept
        again = generate(tiered, PROMPT)
        assert again["output_ids"] == expected
        state = tiered.wait_idle()
        backend = state["hicache"]["storage"]["backend"]
        assert backend["corrupt"] > 0 and state["hicache"]["storage"]["corrupt_pages"] == backend["corrupt"]
        assert again["meta_info"]["cached_tokens"] < 16, again["meta_info"]   # nothing came from bad pages
        assert state["integrity_ok"]
    finally:
        stop_server(tiered)
        stop_server(plain)
