"""Shared test setup: a per-session cache dir for built-in models, few torch threads."""

import os
import tempfile

import pytest

os.environ.setdefault("KVSTRATA_CACHE_DIR", os.path.join(tempfile.gettempdir(), "kvstrata-test-cache"))


def pytest_collection_modifyitems(config, items):
    """Skip tests marked gpu when CUDA is absent."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


pytest_plugins = ["tests.mooncake_fixtures"]
