"""`kvstrata bench engine --profile` on the tiny model: every scenario is broken down, and the parts of the
forward add up to the forward (operators + Python overhead), with the compiled kernel's op attributed."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvstrata.bench.engine_profile import FORWARD_ROWS, format_table, run_profile
from kvstrata.bench.engines import make_engine, prompt_maker
from kvstrata.model.paged_kernels import paged_attention_op


def test_profile_breaks_each_step_down():
    args = argparse.Namespace(model_path="tiny", dtype="bfloat16", threads=1, context=96, decode_tokens=4,
                              streams=2, repeat=1, page_size=1, device="cpu", load_format="auto", suffix=32,
                              enable_hierarchical_cache=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        results = run_profile(args, lambda: make_engine(args, radix_cache=True), prompt_maker)
    finally:
        torch.set_num_threads(threads)
    assert list(results) == ["prefill 96", "extend 32 after 96", "decode 1 stream", "decode 2 streams"]
    for name, row in results.items():
        assert row["step"] >= row["model forward"] > 0, name
        parts = sum(row[r] for r in FORWARD_ROWS)
        assert abs(parts - row["model forward"]) < 1e-6 * max(1.0, row["model forward"]), name
        assert row["linear"] > 0 and row["attention kernel"] > 0, name
    if paged_attention_op() is not None:          # decode attention is the kernel, with no gather
        assert results["decode 2 streams"]["K/V gather"] == 0
    table = format_table(results)
    assert "| step |" in table and "|   Python overhead |" in table


def test_extend_step_refuses_an_uncached_prefix():
    """Without the radix cache the extend scenario would time a plain prefill: it says so instead."""
    args = argparse.Namespace(model_path="tiny", dtype="bfloat16", threads=1, context=64, decode_tokens=4,
                              streams=1, repeat=1, page_size=1, device="cpu", load_format="auto", suffix=16,
                              enable_hierarchical_cache=False)
    with pytest.raises(RuntimeError, match="prefix tokens cached"):
        run_profile(args, lambda: make_engine(args), prompt_maker)
