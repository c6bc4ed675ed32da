"""The CPU probes on the three kinds of machine seen so far, and the paths the runtime picks from them."""

from __future__ import annotations

import pytest
import torch

from kvstrata import platform
from kvstrata.model.layers import onednn_weights_apply
from tests.cpu_kinds import KINDS

# kind: (avx2, avx512f, avx512_bf16, amx, fast bf16 -> dtype auto is bf16, oneDNN bf16 reorder)
EXPECTED = {
    "zen3": (True, False, False, False, False, False),
    "zen4": (True, True, True, False, True, True),
    "xeon": (True, True, True, True, True, True),
}


@pytest.fixture(params=sorted(KINDS))
def kind(request, monkeypatch) -> str:
    """Pretend this machine's /proc/cpuinfo flags are those of one kind."""
    monkeypatch.setattr(platform, "cpu_flags_line", lambda: KINDS[request.param])
    return request.param


def test_probes_on_each_kind(kind):
    got = (platform.cpu_has_avx2(), platform.cpu_has_avx512f(), platform.cpu_has_avx512_bf16(),
           platform.cpu_has_amx(), platform.cpu_has_fast_bf16(), platform.cpu_has_onednn_bf16_reorder())
    assert got == EXPECTED[kind]


def test_only_amx_cpus_prepack_weights_for_onednn(kind):
    """Zen 3 has no bf16 reorder in oneDNN at all (the suite once asked it for one there): never prepacked."""
    prepack = onednn_weights_apply(torch.bfloat16, deterministic=False)
    assert prepack == (kind == "xeon" and torch.backends.mkldnn.is_available())
    assert not onednn_weights_apply(torch.float32, deterministic=False)
    assert not onednn_weights_apply(torch.bfloat16, deterministic=True)   # oneDNN's AMX sums are not row-invariant


def test_this_machine_reads_its_own_flags():
    assert platform.cpu_flags() == frozenset(platform.cpu_flags_line().split(":", 1)[-1].split())
    if platform.is_x86_64():
        assert "sse2" in platform.cpu_flags()


def test_large_buffers_are_unmapped_only_while_loading(monkeypatch):
    """A load maps big buffers on their own (its transients leave the RSS); serving must not (every tile would
    be a fresh, page-faulted mapping): the outermost scope's end sets the serving thresholds, even on an error."""
    calls: list[tuple] = []
    monkeypatch.setattr(platform, "_glibc", lambda *args: calls.append(args))
    serving = [("mallopt", -3, platform.SERVE_MMAP_THRESHOLD_BYTES),
               ("mallopt", -1, platform.SERVE_TRIM_THRESHOLD_BYTES)]
    with pytest.raises(RuntimeError):
        with platform.large_buffers_unmapped():
            with platform.large_buffers_unmapped():
                assert calls == [("mallopt", -3, platform.LOAD_MMAP_THRESHOLD_BYTES)]
            assert len(calls) == 1          # the inner end leaves the load's threshold in place
            raise RuntimeError("the load failed")
    assert calls[1:] == serving

    @platform.large_buffers_unmapped()
    def load() -> None:
        assert calls[-1] == ("mallopt", -3, platform.LOAD_MMAP_THRESHOLD_BYTES)

    load()
    assert calls[-2:] == serving


def _vma_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(part, 16) for part in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="no madvise(MADV_HUGEPAGE) here")
def test_huge_page_buffers_are_private_and_advised_only_on_whole_huge_pages():
    assert platform.huge_page_buffer(2 * platform.HUGE_PAGE_BYTES - 1) is None     # too small to hold one
    size = 5 * platform.HUGE_PAGE_BYTES + 12345
    region = platform.huge_page_buffer(size)
    held = torch.frombuffer(region, dtype=torch.uint8)
    assert held.numel() == size and held.data_ptr() % 4096 == 0 and int(held.sum()) == 0
    held[-1] = 7     # private and writable
    start = held.data_ptr()
    first = start + (-start) % platform.HUGE_PAGE_BYTES
    # the aligned whole pages carry the advice ("hg"); the partial page before them does not
    assert "hg" in _vma_flags(first)
    if first != start:
        assert "hg" not in _vma_flags(start)
    assert "sh" not in _vma_flags(first)       # not shared memory, which gets no huge pages
