"""L3 objects are page groups: after a multi-turn benchmark the file backend holds a number of files that
follows the data (stored tokens / 64, plus at most one partial object per conversation), whatever the
device page size, and every file is a whole group with its checksum trailer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvstrata.bench import multiturn
from kvstrata.bench.launcher import ServerProcess
from kvstrata.storage.page_checksum import TRAILER_BYTES

CLIENTS, ROUNDS, REQUEST, OUTPUT = 4, 3, 80, 4
GROUP_TOKENS = 64
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def object_files(root: Path) -> list[Path]:
    """Stored objects (temp files of writers in progress start with a dot)."""
    return [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]


@pytest.mark.parametrize("page_size", [1, 16])
def test_file_count_follows_the_data_not_the_page_size(tmp_path, page_size):
    storage = tmp_path / "kv"
    flags = ["--model-path", "tiny", "--max-total-tokens", "4096", "--random-seed", "0", "--log-level", "warning",
             "--page-size", str(page_size), "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
             "--hicache-storage-dir", str(storage)]
    log = tmp_path / "results.jsonl"
    with ServerProcess(flags, str(tmp_path / "server.log"), env=ENV).start(timeout_s=300) as server:
        rc = multiturn.main(["--port", str(server.port), "--model-path", "tiny", "--num-clients", str(CLIENTS),
                             "--num-rounds", str(ROUNDS), "--request-length", str(REQUEST),
                             "--output-length", str(OUTPUT), "--max-parallel", "2", "--request-rate", "inf",
                             "--log-file", str(log), "--no-progress"])
        assert rc == 0 and json.loads(log.read_text())["summary"]["completed"] == CLIENTS * ROUNDS
        deadline = time.monotonic() + 60
        while not object_files(storage) and time.monotonic() < deadline:   # L3 writes are asynchronous
            time.sleep(0.2)
        time.sleep(1.0)
    # A conversation's final history is every question and answer: the most any process could store.
    stored_tokens = CLIENTS * ROUNDS * (REQUEST + OUTPUT)
    files = object_files(storage)
    assert 0 < len(files) <= stored_tokens // GROUP_TOKENS + CLIENTS, len(files)
    sizes = {f.stat().st_size for f in files}
    assert len(sizes) == 1 and (sizes.pop() - TRAILER_BYTES) % GROUP_TOKENS == 0
