"""Config parsing and safetensors loading: what loads, and the errors that name what is wrong."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvstrata.model.config import ModelConfig, ModelLoadError
from kvstrata.model.layers import upcasts_on_cpu
from kvstrata.model.loader import load_model
from tests.model.hf_ckpt import edit_checkpoint

CPU = torch.device("cpu")


@pytest.fixture
def llama_copy(checkpoint_dir, tmp_path):
    """A private copy of the tiny Llama checkpoint that a test may damage."""
    dest = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir("llama"), dest)
    return dest


def edit_json(file, **changes) -> None:
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def load(path) -> torch.nn.Module:
    return load_model(str(path), ModelConfig.from_path(str(path)), torch.float32, CPU)


# --- config ---------------------------------------------------------------------------------------

def test_config_reads_transformers_v5_checkpoint(checkpoint_dir):
    config = ModelConfig.from_path(checkpoint_dir("llama"))
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.num_layers) == (4, 2, 16, 2)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 8.0
    assert config.eos_token_ids == (2,) and config.torch_dtype == "float32"
    qwen2 = ModelConfig.from_path(checkpoint_dir("qwen2"))
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    assert qwen2.eos_token_ids == (2, 3)
    qwen3 = ModelConfig.from_path(checkpoint_dir("qwen3_sharded"))
    assert qwen3.qk_norm and qwen3.tie_word_embeddings and not qwen3.attention_bias


def test_config_reads_legacy_rope_fields_and_generation_eos(llama_copy):
    config_file = llama_copy / "config.json"
    data = json.loads(config_file.read_text())
    del data["rope_parameters"]
    data.update(rope_theta=1234.0, rope_scaling={"type": "linear", "factor": 4.0}, torch_dtype="bfloat16")
    config_file.write_text(json.dumps(data))
    edit_json(llama_copy / "generation_config.json", eos_token_id=[2, 9])
    config = ModelConfig.from_path(str(llama_copy))
    assert config.rope_theta == 1234.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.eos_token_ids == (2, 9) and config.torch_dtype == "bfloat16"


def test_mistral_sliding_window_caps_context(llama_copy):
    edit_json(llama_copy / "config.json", architectures=["MistralForCausalLM"], sliding_window=64,
              max_position_embeddings=256)
    assert ModelConfig.from_path(str(llama_copy)).max_position_embeddings == 64


@pytest.mark.parametrize("change, expected", [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ({"hidden_size": None}, "hidden_size"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
])
def test_config_errors_name_the_problem(llama_copy, change, expected):
    edit_json(llama_copy / "config.json", **change)
    with pytest.raises(ModelLoadError, match=expected) as err:
        ModelConfig.from_path(str(llama_copy))
    if "architectures" in change:
        assert "Qwen3ForCausalLM" in str(err.value)  # lists what is supported


def test_missing_folder_and_config_and_bad_json(tmp_path):
    with pytest.raises(ModelLoadError, match="not a directory"):
        ModelConfig.from_path(str(tmp_path / "absent"))
    with pytest.raises(ModelLoadError, match="config.json"):
        ModelConfig.from_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        ModelConfig.from_path(str(tmp_path))


# --- weights --------------------------------------------------------------------------------------

def test_loads_in_target_dtype_with_tied_embeddings(checkpoint_dir):
    path = checkpoint_dir("qwen3_sharded")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    model = load_model(path, ModelConfig.from_path(path), torch.bfloat16, CPU)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_untied_bf16_lm_head_is_widened_only_where_bf16_is_emulated(checkpoint_dir):
    path = checkpoint_dir("llama")
    model = load_model(path, ModelConfig.from_path(path), torch.bfloat16, CPU)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    expected = torch.float32 if upcasts_on_cpu(torch.bfloat16) else torch.bfloat16
    assert model.lm_head.weight.dtype == expected


def test_missing_lm_head_falls_back_to_tied(llama_copy):
    file = llama_copy / "model.safetensors"
    tensors = load_file(file)
    embed = tensors["model.embed_tokens.weight"]
    del tensors["lm_head.weight"]
    save_file(tensors, file)
    model = load(llama_copy)
    assert torch.equal(model.lm_head.weight, embed)


def test_no_safetensors(llama_copy):
    os.remove(llama_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load(llama_copy)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(llama_copy, damage):
    file = llama_copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(b"\x07" * 64 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load(llama_copy)


def test_missing_tensor_is_named(llama_copy):
    edit_checkpoint(llama_copy, drop=("model.layers.1.self_attn.k_proj.weight",))
    with pytest.raises(ModelLoadError, match="model.layers.1.self_attn.k_proj.weight"):
        load(llama_copy)


def test_wrong_shape_is_named_with_shapes(llama_copy):
    edit_checkpoint(llama_copy, put={"model.layers.0.mlp.up_proj.weight": torch.zeros(100, 64)})
    with pytest.raises(ModelLoadError, match=r"up_proj.weight.*\(100, 64\).*\(128, 64\)"):
        load(llama_copy)


def test_unexpected_tensor_is_named(llama_copy):
    edit_checkpoint(llama_copy, put={"model.layers.0.mlp.gate_proj.bias": torch.zeros(128)})
    with pytest.raises(ModelLoadError, match="gate_proj.bias"):
        load(llama_copy)


def test_index_naming_absent_shard(checkpoint_dir, tmp_path):
    dest = tmp_path / "sharded"
    shutil.copytree(checkpoint_dir("qwen3_sharded"), dest)
    shard = sorted(f for f in os.listdir(dest) if f.startswith("model-"))[0]
    os.remove(dest / shard)
    with pytest.raises(ModelLoadError, match=shard):
        load(dest)
