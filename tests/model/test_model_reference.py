"""Model references: local paths and built-ins pass through, Hugging Face ids come from the local cache (never
the network), an unknown id is a clear error, and a config-only folder borrows a built-in tokenizer."""

from __future__ import annotations

import json
import os
import socket

import pytest

from kvstrata.args import ConfigError, ServerArgs
from kvstrata.model.builtin import resolve_model_path
from kvstrata.model.reference import ModelNotFound, resolve_model_references, resolve_reference
from tests.model.fake_hub import MAIN_REV, OLD_REV, make_fake_hub, snapshot_dir

REPO = "kvstrata-test/tiny"


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a socket fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_a_hub_id_resolves_to_its_cached_snapshot_at_main_or_at_a_revision(tmp_path, no_network):
    hub = make_fake_hub(tmp_path / "hub", REPO)
    assert resolve_reference(REPO, None, str(hub)) == snapshot_dir(hub, REPO, MAIN_REV)
    assert resolve_reference(REPO, OLD_REV, str(hub)) == snapshot_dir(hub, REPO, OLD_REV)
    model, tokenizer = resolve_model_references(REPO, None, OLD_REV, "auto", str(hub))
    assert model == tokenizer == snapshot_dir(hub, REPO, OLD_REV)


def test_local_paths_and_built_ins_pass_through(tmp_path, no_network):
    assert resolve_reference("tiny") == "tiny"
    assert resolve_reference(str(tmp_path)) == str(tmp_path)
    assert resolve_reference("/no/such/folder") == "/no/such/folder"     # the loader names it


def test_an_unknown_id_names_the_cache_it_was_looked_for_in(tmp_path, no_network):
    hub = make_fake_hub(tmp_path / "hub", REPO)
    with pytest.raises(ModelNotFound) as e:
        resolve_reference("org/missing", None, str(hub))
    message = str(e.value)
    assert "'org/missing' not found" in message and str(hub) in message
    assert "huggingface-cli download org/missing" in message
    with pytest.raises(ModelNotFound, match="at revision 'v9'"):
        resolve_reference(REPO, "v9", str(hub))


def test_server_args_resolve_an_unknown_id_to_a_config_error(no_network):
    with pytest.raises(ConfigError, match="'org/missing' not found"):
        ServerArgs(model_path="org/missing").resolve(with_device=False)


def test_a_config_only_folder_with_dummy_weights_borrows_a_built_in_tokenizer_that_fits(tmp_path, caplog):
    with open(os.path.join(resolve_model_path("bench"), "config.json")) as fh:
        config = json.load(fh)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, tokenizer = resolve_model_references(str(tmp_path), None, None, "dummy")
    assert (model, tokenizer) == (str(tmp_path), "bench")
    assert "has no tokenizer files" in caplog.text
    config["vocab_size"] = 512
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelNotFound, match="pass --tokenizer-path"):
        resolve_model_references(str(tmp_path), None, None, "dummy")
    assert resolve_model_references(str(tmp_path), "tiny", None, "dummy") == (str(tmp_path), "tiny")


def test_dummy_weights_are_deterministic_and_need_only_config_json(tmp_path):
    import torch

    from kvstrata.model.config import ModelConfig
    from kvstrata.model.loader import load_dummy_model

    with open(os.path.join(resolve_model_path("tiny"), "config.json")) as fh:
        (tmp_path / "config.json").write_text(fh.read())
    config = ModelConfig.from_path(str(tmp_path))
    a = load_dummy_model(config, torch.float32, torch.device("cpu"))
    b = load_dummy_model(config, torch.float32, torch.device("cpu"))
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
        assert torch.isfinite(x).all(), name
    norms = [x for name, x in a.state_dict().items() if name.endswith("norm.weight")]
    assert norms and all(bool((x == 1).all()) for x in norms)


@pytest.mark.parametrize("architecture,model_type", [
    ("LlamaForCausalLM", "llama"), ("MistralForCausalLM", "mistral"), ("Qwen2ForCausalLM", "qwen2"),
    ("Qwen3ForCausalLM", "qwen3")])
def test_every_supported_architecture_serves_dummy_weights_from_config_json_alone(tmp_path, architecture,
                                                                                 model_type):
    import kvstrata

    with open(os.path.join(resolve_model_path("tiny"), "config.json")) as fh:
        config = json.load(fh)
    config.update(architectures=[architecture], model_type=model_type, sliding_window=None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with kvstrata.Engine(model_path=str(tmp_path), load_format="dummy", dtype="float32", max_total_tokens=1024,
                         random_seed=0) as engine:
        assert engine.server_args.tokenizer_path == "tiny"            # borrowed: the folder has none
        out = engine.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 3, "ignore_eos": True,
                                                                       "temperature": 0})
        assert out["meta_info"]["completion_tokens"] == 3
