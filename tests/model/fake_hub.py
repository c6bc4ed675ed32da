"""A Hugging Face hub cache built on disk, laid out as huggingface_hub lays it out (no network involved).

    <cache>/models--<org>--<name>/refs/main            the commit hash 'main' points at
    <cache>/models--<org>--<name>/snapshots/<hash>/    the files of that commit
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kvstrata.model.builtin import resolve_model_path

MAIN_REV = "1" * 40
OLD_REV = "2" * 40


def make_fake_hub(cache: Path, repo_id: str = "kvstrata-test/tiny", source: str = "tiny") -> Path:
    """`repo_id` with two snapshots (MAIN_REV, which refs/main names, and OLD_REV), each a copy of the built-in
    `source` model's folder; returns the cache folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    folder = resolve_model_path(source)
    for rev in (MAIN_REV, OLD_REV):
        shutil.copytree(folder, repo / "snapshots" / rev)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(MAIN_REV)
    (repo / "blobs").mkdir()
    return cache


def snapshot_dir(cache: Path, repo_id: str, rev: str) -> str:
    """Where `rev` of `repo_id` lies in the fake cache."""
    return os.path.join(cache, "models--" + repo_id.replace("/", "--"), "snapshots", rev)
