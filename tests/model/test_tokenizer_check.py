"""The scheduler's tokenizer choice: a LightTokenizer only where transformers' own tokenizer of the folder was
recorded with the same fingerprint (a generic folder), transformers' tokenizer otherwise (a model-specific
class, no record, a record of other files or versions)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kvstrata.args import ServerArgs
from kvstrata.model import tokenizer_check
from kvstrata.model.builtin import resolve_model_path
from kvstrata.model.light_tokenizer import LightTokenizer, fingerprint
from kvstrata.model.tokenizer import load_checked_tokenizer
from kvstrata.model.tokenizer_check import needs_record, record_fingerprint, recorded_fingerprint
from kvstrata.server.launch import prepare_model_folders


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    # Same cache folder as test_builtin.py / test_tokenizer.py: each built-in is built once per session.
    return resolve_model_path("tiny", str(tmp_path_factory.getbasetemp() / "kvstrata-model-cache"))


@pytest.fixture(autouse=True)
def no_records(tmp_path, monkeypatch):
    """An empty record directory (the records live under the cache directory)."""
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp_path / "cache"))


def _copy(tiny_dir: str, out: str, tokenizer_class: str | None = None) -> str:
    shutil.copytree(tiny_dir, out)
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as fh:
        config = json.load(fh)
    config["tokenizer_class"] = tokenizer_class or config["tokenizer_class"]
    with open(path, "w") as fh:
        json.dump(config, fh)
    return out


def test_a_generic_folder_gets_the_light_tokenizer_once_recorded(tiny_dir):
    assert needs_record(tiny_dir) and recorded_fingerprint(tiny_dir) is None
    assert not isinstance(load_checked_tokenizer(tiny_dir), LightTokenizer)     # no record: transformers
    recorded = record_fingerprint(tiny_dir)
    assert recorded is not None and recorded_fingerprint(tiny_dir) == recorded and not needs_record(tiny_dir)
    chosen = load_checked_tokenizer(tiny_dir)
    assert isinstance(chosen, LightTokenizer) and fingerprint(chosen) == recorded


def test_a_model_specific_class_gets_transformers_tokenizer(tiny_dir, tmp_path):
    # Qwen2Tokenizer rebuilds the pipeline in Python: the record says so, whatever tokenizer.json holds.
    folder = _copy(tiny_dir, str(tmp_path / "qwen2"), "Qwen2Tokenizer")
    recorded = record_fingerprint(folder)
    chosen = load_checked_tokenizer(folder)
    assert not isinstance(chosen, LightTokenizer) and type(chosen).__name__ == "Qwen2Tokenizer"
    assert fingerprint(chosen) == recorded != fingerprint(LightTokenizer.from_folder(folder))


def test_a_record_holds_only_for_the_same_files_and_versions(tiny_dir, tmp_path, monkeypatch):
    folder = _copy(tiny_dir, str(tmp_path / "tiny"))
    record_fingerprint(folder)
    assert not needs_record(folder)
    with open(os.path.join(folder, "config.json")) as fh:     # the model type decides AutoTokenizer's class
        config = json.load(fh)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump({**config, "model_type": "qwen2"}, fh)
    assert needs_record(folder)
    record_fingerprint(folder)
    monkeypatch.setattr(tokenizer_check, "_version", lambda package: "0.0.0")
    assert needs_record(folder)
    assert not isinstance(load_checked_tokenizer(folder), LightTokenizer)


def test_a_folder_without_tokenizer_json_needs_no_record(tiny_dir, tmp_path):
    folder = _copy(tiny_dir, str(tmp_path / "no-json"))
    os.remove(os.path.join(folder, "tokenizer.json"))
    assert not needs_record(folder)


def test_the_server_records_it_before_the_scheduler_starts(tiny_dir):
    # In a child process (spawn): the server's own process never imports transformers.
    assert needs_record(tiny_dir)
    prepare_model_folders(ServerArgs(model_path=tiny_dir))
    assert not needs_record(tiny_dir) and isinstance(load_checked_tokenizer(tiny_dir), LightTokenizer)
