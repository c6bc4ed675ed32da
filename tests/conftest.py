"""Shared test setup: a per-session cache dir for built-in models, the capability and GPU markers."""

import os
import tempfile
from collections import Counter

import pytest

from tests import capabilities

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


def pytest_runtest_setup(item):
    """Apply the capability markers (tests/capabilities.py)."""
    capabilities.check(item)


def pytest_report_header(config) -> str:
    return capabilities.cpu_summary()


def pytest_terminal_summary(terminalreporter):
    """Which tests this machine skipped for want of a capability, by capability: the kernel variants and
    paths that this run did not check."""
    skipped = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        skipped[reason.removeprefix("Skipped: ")] += 1
    terminalreporter.section("skipped on this machine, by reason")
    terminalreporter.write_line(capabilities.cpu_summary())
    for reason, count in sorted(skipped.items()):
        terminalreporter.write_line(f"{count:4d} skipped: {reason}")
    if not skipped:
        terminalreporter.write_line("none")


pytest_plugins = ["tests.mooncake_fixtures"]
