"""Per-layer FP8 KV scales from a checkpoint (model/kv_scales.py): the tensor names vLLM and SGLang read are
accepted by the loader, read into the pool's format, and named in the KV namespace by their digest."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvstrata.cache.page_hash import page_keys
from kvstrata.cache.storage_io import kv_namespace
from kvstrata.memory.kv_format import KVFormat
from kvstrata.model.builtin import resolve_model_path
from kvstrata.model.config import ModelConfig, ModelLoadError
from kvstrata.model.kv_scales import read_kv_scales
from tests.model.hf_ckpt import edit_checkpoint
from tests.runtime.helpers import make_engine


@pytest.fixture
def scaled_tiny(tmp_path) -> tuple[str, int]:
    """A copy of the tiny model with K/V scales under three naming conventions; (folder, layers)."""
    dest = tmp_path / "tiny-scaled"
    shutil.copytree(resolve_model_path("tiny"), dest)
    layers = ModelConfig.from_path(str(dest)).num_layers
    edit_checkpoint(dest, put={"model.layers.0.self_attn.k_scale": torch.tensor(2.0),
                               "model.layers.0.self_attn.v_scale": torch.tensor([0.5]),
                               f"model.layers.{layers - 1}.self_attn.k_proj.output_scale": torch.tensor(4.0),
                               f"model.layers.{layers - 1}.self_attn.kv_scale": torch.tensor(3.0)})
    return str(dest), layers


def test_scales_are_read_and_the_loader_accepts_them(scaled_tiny):
    folder, layers = scaled_tiny
    k, v = read_kv_scales(folder, ["model.safetensors"], layers)
    assert k[0] == 2.0 and v[0] == 0.5 and v[-1] == 3.0 and k[-1] in (3.0, 4.0)
    assert set(k[1:-1]) <= {1.0} and set(v[1:-1]) <= {1.0}   # layers without a scale: 1.0
    prompt = {"input_ids": list(range(100, 140)), "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    for kv in ("auto", "fp8_e4m3"):
        engine = make_engine(model_path=folder, kv_cache_dtype=kv, dtype="bfloat16")
        try:
            assert len(engine.generate(**prompt)["output_ids"]) == 4
            digest = engine.get_server_info()["internal_states"][0]["kv_cache"]["scales_digest"]
        finally:
            engine.shutdown()
        expected = KVFormat.of(kv, torch.bfloat16, layers, (k, v)).scales_digest
        assert digest == expected and (digest != "") == (kv != "auto")


def test_a_bad_scale_is_refused(scaled_tiny):
    folder, layers = scaled_tiny
    edit_checkpoint(folder, put={"model.layers.1.self_attn.v_scale": torch.tensor(0.0)})
    with pytest.raises(ModelLoadError, match="must be a positive number"):
        read_kv_scales(folder, ["model.safetensors"], layers)
    edit_checkpoint(folder, put={"model.layers.1.self_attn.v_scale": torch.ones(4)})
    with pytest.raises(ModelLoadError, match="only one KV scale per layer"):
        read_kv_scales(folder, ["model.safetensors"], layers)


def test_the_kv_namespace_names_the_dtype_and_the_scales():
    ones = KVFormat.of("fp8_e4m3", torch.bfloat16, 2)
    scaled = KVFormat.of("fp8_e4m3", torch.bfloat16, 2, ((1.0, 2.0), (1.0, 1.0)))
    formats = [KVFormat(torch.bfloat16), ones, scaled, KVFormat.of("fp8_e5m2", torch.bfloat16, 2)]
    assert formats[0].name == "torch.bfloat16"   # the model dtype's namespace is what it always was
    keys = {page_keys(list(range(16)), 16, kv_namespace(resolve_model_path("tiny"), f.name, 16))[0] for f in formats}
    assert len(keys) == len(formats)
