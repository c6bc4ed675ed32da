"""Model references: what `--model-path` and `--tokenizer-path` name, turned into something local.

A reference is, in this order:

    an existing local path        a checkpoint folder or a GGUF file: used as it is
    a built-in or packaged name   'tiny', 'bench', a packaged GGUF: built or converted on first use
    a Hugging Face id (org/name)  its snapshot folder in the local Hugging Face cache ($HF_HUB_CACHE, else
                                  $HF_HOME/hub, else ~/.cache/huggingface/hub), at `--revision`

Nothing is ever downloaded: the hub is asked with `local_files_only=True`, and an id that is not in the cache
is a start-up error naming the cache it was looked for in. A string that is none of these and does not look
like an id (an absolute path that does not exist) is passed on, and the loader names it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Optional

logger = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# Built-in tokenizers a config-only folder may borrow (--load-format dummy), largest vocabulary first.
_FALLBACK_TOKENIZERS = (("bench", 32000), ("tiny", 1024))


class ModelNotFound(LookupError):
    """A model or tokenizer reference that names nothing local."""


def resolve_model_references(model: str, tokenizer: Optional[str], revision: Optional[str],
                             load_format: str, hub_cache: Optional[str] = None) -> tuple[str, str]:
    """(model path, tokenizer path), both local paths or built-in names; see the module docstring.

    Without a tokenizer reference the model's own folder is used; with `load_format == "dummy"` and no
    tokenizer files there, a built-in tokenizer whose vocabulary fits the model's (with a warning).
    """
    model_path = resolve_reference(model, revision, hub_cache)
    if tokenizer is not None:
        return model_path, resolve_reference(tokenizer, revision, hub_cache)
    if load_format == "dummy" and os.path.isdir(model_path):
        from kvstrata.model.tokenizer import has_tokenizer_files

        if not has_tokenizer_files(model_path):
            return model_path, _fallback_tokenizer(model_path)
    return model_path, model_path


def resolve_reference(ref: str, revision: Optional[str] = None, hub_cache: Optional[str] = None) -> str:
    """A local path or built-in name for `ref`; a Hugging Face id becomes its cached snapshot folder
    (`hub_cache`: the cache folder, default huggingface_hub's, from the environment at its import)."""
    from kvstrata.model.builtin import BUILTIN_MODELS
    from kvstrata.model.gguf import is_gguf

    if ref in BUILTIN_MODELS or is_gguf(ref) or os.path.exists(os.path.expanduser(ref)):
        return ref
    if not _HUB_ID.match(ref):
        return ref
    return hub_snapshot(ref, revision, hub_cache)


def hub_snapshot(repo_id: str, revision: Optional[str] = None, hub_cache: Optional[str] = None) -> str:
    """The folder of `repo_id` at `revision` in the local Hugging Face cache; never a network call."""
    from huggingface_hub import constants, snapshot_download

    hub_cache = hub_cache or constants.HF_HUB_CACHE
    try:
        return snapshot_download(repo_id=repo_id, revision=revision, cache_dir=hub_cache, local_files_only=True)
    except Exception as e:  # LocalEntryNotFoundError, HFValidationError, a broken cache entry: all "not here"
        from kvstrata.model.builtin import BUILTIN_MODELS

        raise ModelNotFound(
            f"model {repo_id!r} not found: it is not a local folder or file, not a built-in model "
            f"({', '.join(BUILTIN_MODELS)}), and the Hugging Face cache {hub_cache} has no "
            f"snapshot of it at revision {revision or 'main'!r} ({type(e).__name__}). Nothing is downloaded "
            f"at run time: run `huggingface-cli download {repo_id}` first, or pass a local folder.") from None


def _fallback_tokenizer(model_path: str) -> str:
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as fh:
            vocab = int(json.load(fh)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelNotFound(f"{model_path}: cannot read vocab_size from config.json: {e}") from None
    for name, size in _FALLBACK_TOKENIZERS:
        if size <= vocab:
            logger.warning("%s has no tokenizer files: using the built-in %r tokenizer (%d tokens, the model "
                           "has %d); pass --tokenizer-path for the model's own", model_path, name, size, vocab)
            return name
    raise ModelNotFound(f"{model_path} has no tokenizer files and its vocabulary ({vocab}) is smaller than "
                        f"every built-in tokenizer's: pass --tokenizer-path")
