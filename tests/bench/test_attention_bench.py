"""`kvstrata bench engine --attention` on the tiny model: every case measured through paged_attention, the
kernel column present exactly where the kernel is."""

from __future__ import annotations

import argparse

import torch

from kvstrata.bench.attention_bench import attention_cases, format_attention
from kvstrata.bench.engine_bench import main
from kvstrata.model.paged_kernels import extend_attention_op, paged_attention_op


def test_attention_cases_and_table(capsys):
    results = attention_cases(argparse.Namespace(model_path="tiny", context=96, repeat=1, streams=3))
    assert [r["case"] for r in results] == ["prefill 96", "extend 24 after 48", "decode 3 x 96",
                                            "decode 3 x 96, float32 kernel"]
    for r in results:
        assert r["torch_ms"] > 0 and r["torch_gflops"] > 0
    for r in results[:2]:
        assert (r["kernel_ms"] is not None) == (extend_attention_op() is not None)
    for r in results[2:]:
        assert (r["kernel_ms"] is not None) == (paged_attention_op() is not None)
    assert "| prefill 96 | 2 |" in format_attention(results, 2)
    threads = torch.get_num_threads()
    try:
        assert main(["--attention", "--model-path", "tiny", "--context", "64", "--repeat", "1", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "| extend 16 after 32 | 1 |" in capsys.readouterr().out
