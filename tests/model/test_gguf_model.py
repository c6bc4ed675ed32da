"""GGUF files served with their weights quantized: files of the tiny shape written by the `gguf` package's own
quantizer give the logits of the dense path on the same weights de-quantized; a corrupt or truncated tensor is
a load error naming it; greedy output is identical with no cache, L1, L2 and L2 + file L3 (deterministic)."""

from __future__ import annotations

import os

import pytest
import torch

from kvstrata.model.builtin import resolve_model_path
from kvstrata.model.config import ModelConfig, ModelLoadError
from kvstrata.model.gguf_loader import load_gguf_model
from kvstrata.model.layers import Linear
from kvstrata.model.loader import load_model
from kvstrata.model.quant.gguf_weight import GGUFEmbedding, GGUFWeight, use_gguf_kernels
from tests.model.gguf_files import write_tiny_gguf
from tests.runtime.helpers import assert_greedy_identical_across_tiers

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0"]


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """type -> (GGUF file, de-quantized safetensors folder)."""
    out = str(tmp_path_factory.mktemp("tiny-gguf"))
    return {t: write_tiny_gguf(out, t) for t in TYPES}


def _logits(model, ids: list[int]) -> torch.Tensor:
    from kvstrata.memory.device_pool import DeviceKVPool
    from tests.model.forward_batch import PagedSequences

    c = model.config
    pool = DeviceKVPool(64, 16, c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, torch.device("cpu"))
    seqs = PagedSequences(pool)
    input_ids, positions, meta = seqs.batch([(0, ids)])
    return model(input_ids, positions, meta, pool)


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "compiled"])
def test_quantized_logits_equal_the_dense_path_on_the_dequantized_weights(tiny_files, kernels):
    from kvstrata.model.paged_kernels import gguf_ops

    ops = gguf_ops() if kernels else None
    if kernels and ops is None:
        pytest.skip("no compiled CPU kernels")
    ids = list(range(3, 40, 2))
    for type_name, (path, folder) in tiny_files.items():
        config = ModelConfig.from_path(resolve_model_path(path))
        quantized = load_gguf_model(path, config, torch.float32, torch.device("cpu"))
        use_gguf_kernels(quantized, ops)
        weights = [m for m in quantized.modules() if isinstance(m, GGUFWeight)]
        assert {w.fmt.name for w in weights} == {type_name}
        assert isinstance(quantized.model.embed_tokens, GGUFEmbedding)
        assert quantized.lm_head.quantized is quantized.model.embed_tokens.table    # tied: one copy
        assert all(m.weight.numel() == 0 for m in quantized.modules() if isinstance(m, Linear))
        dense = load_model(folder, ModelConfig.from_path(folder), torch.float32, torch.device("cpu"))
        expected = _logits(dense, ids)
        got = _logits(quantized, ids)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=type_name)


def _rewrite(path: str, out: str, edit) -> str:
    import gguf

    reader = gguf.GGUFReader(path)
    data = bytearray(open(path, "rb").read())
    edit(reader, data)
    with open(out, "wb") as fh:
        fh.write(data)
    return out


def test_corrupt_or_truncated_tensor_is_a_load_error_naming_it(tiny_files, tmp_path):
    path, _ = tiny_files["Q8_0"]
    config = ModelConfig.from_path(resolve_model_path(path))
    last = None

    def nan_scale(reader, data):
        t = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
        data[t.data_offset + 34 * 5: t.data_offset + 34 * 5 + 2] = b"\x00\x7e"   # float16 NaN scale

    def truncate(reader, data):
        nonlocal last
        last = max(reader.tensors, key=lambda t: t.data_offset)
        del data[last.data_offset + last.n_bytes // 2:]

    corrupt = _rewrite(path, str(tmp_path / "corrupt.gguf"), nan_scale)
    with pytest.raises(ModelLoadError, match="'blk.1.ffn_up.weight' is corrupt"):
        load_gguf_model(corrupt, config, torch.float32, torch.device("cpu"))
    truncated = _rewrite(path, str(tmp_path / "truncated.gguf"), truncate)
    with pytest.raises(ModelLoadError, match=f"tensor {last.name!r} is truncated"):
        load_gguf_model(truncated, config, torch.float32, torch.device("cpu"))


def test_unserved_tensor_type_is_a_load_error_naming_it(tmp_path):
    import gguf

    path = str(tmp_path / "q2k.gguf")
    writer = gguf.GGUFWriter(path, "qwen3")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 84, dtype=torch.uint8).numpy(),
                      raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = ModelConfig.from_path(resolve_model_path("tiny"))
    with pytest.raises(ModelLoadError, match="'token_embd.weight' has GGUF type Q2_K"):
        load_gguf_model(path, config, torch.float32, torch.device("cpu"))


def test_greedy_identical_without_cache_and_with_l1_l2_l3_deterministic(tiny_files, tmp_path):
    path, _ = tiny_files["Q4_0"]
    assert_greedy_identical_across_tiers(str(tmp_path / "l3"), rounds=3, model_path=path, tokenizer_path="tiny")
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]


def test_header_reader_agrees_with_gguf_and_names_a_corrupt_file(tiny_files, tmp_path):
    import gguf

    from kvstrata.model.gguf_header import read_header

    path, _ = tiny_files["Q4_1"]
    header = read_header(path)
    reader = gguf.GGUFReader(path)
    assert [(t.name, t.shape, t.type_id, t.offset, t.n_bytes) for t in header.tensors] == [
        (t.name, tuple(int(v) for v in reversed(t.shape)), int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors]
    assert header.fields["general.architecture"] == "qwen3" and header.fields["qwen3.block_count"] == 2
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(open(path, "rb").read(200))     # the header cut short
    with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF file"):
        read_header(str(bad))
