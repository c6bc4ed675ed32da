"""Shared fixtures for model tests: tiny random-weight HF checkpoints written once per session."""

from __future__ import annotations

import pytest

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
