"""Shared fixtures for model tests: tiny random-weight HF checkpoints written once per session."""

from __future__ import annotations

import sys

import pytest

from kvstrata.model.paged_kernels import extend_amx
from tests.model.hf_ckpt import write_checkpoint


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """checkpoint_dir(case) -> folder of that case's checkpoint, written on first use."""
    written: dict[str, str] = {}

    def get(case: str) -> str:
        if case not in written:
            written[case] = write_checkpoint(case, str(tmp_path_factory.mktemp(case)))
        return written[case]

    return get


@pytest.fixture(scope="module", autouse=True)
def _drop_loaded_pairs():
    """Loaded model pairs live for one test module (they hold two models each)."""
    yield
    pairs = sys.modules.get("tests.model.pairs")    # only a module that used pairs has any to drop
    if pairs is not None:
        pairs.Pair.drop_all()


@pytest.fixture(params=["amx", "dot-product"] if extend_amx(True) else ["this-cpu"])
def tile(request) -> str:
    """Runs the test on each extend tile this build has for bf16 (AMX machines: AMX, then the dot-product tile)."""
    extend_amx(request.param != "dot-product")
    yield request.param
    extend_amx(True)
