"""The settings transformers 5 reads from a tokenizer folder next to tokenizer.json, merged in its order.

Steps (transformers' `_from_pretrained`, then `PreTrainedTokenizerBase.__init__`):
  1. tokenizer_config.json; add_bos_token / add_eos_token dropped (tokenizer.json's post-processor rules);
  2. chat_template.jinja and additional_chat_templates/*.jinja replace the config's chat_template;
  3. additional_special_tokens -> extra_special_tokens; string `*_token` keys beyond the standard seven and a
     dict extra_special_tokens -> model-specific special tokens;
  4. with `added_tokens_decoder` in the config: that; without it, special_tokens_map.json overrides the config,
     then added_tokens.json and tokenizer.json's added tokens make the decoder;
  5. serialized AddedTokens ({"__type": "AddedToken"}) become AddedTokens; a named special token whose text is
     an added token takes that token's flags;
  6. remaining `*_token` keys (now also AddedTokens) join the model-specific ones.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any, Optional, Union

from tokenizers import AddedToken

STANDARD_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
VERY_LARGE_INTEGER = int(1e30)     # transformers' model_max_length when none is configured


@dataclass
class TokenizerSettings:
    """What a folder configures on top of tokenizer.json."""

    special: dict[str, Any]              # named special token -> str or AddedToken (standard names first)
    extra_special: list[Any]
    added_tokens: dict[int, AddedToken]  # the configured added tokens (re-added to the tokenizer at load)
    chat_template: Union[str, dict[str, str], None]
    clean_up_tokenization_spaces: bool
    clean_up_bpe: bool                   # clean up even for BPE models (transformers skips that by default)
    split_special_tokens: bool
    model_max_length: int


def read_settings(folder: str, json_added_tokens: dict[int, AddedToken],
                  json_pad_token: Optional[str] = None) -> TokenizerSettings:
    """The settings of `folder`; `json_added_tokens` / `json_pad_token` come from its tokenizer.json."""
    config = _config_with_templates(folder)                                        # steps 1 and 2
    explicit = _pop_model_specific(config)                                         # step 3
    if "added_tokens_decoder" in config:                                           # step 4
        added = {int(i): AddedToken(**t) if isinstance(t, dict) else t for i, t in config["added_tokens_decoder"].items()}
    else:
        explicit.update(_merge_special_tokens_map(folder, config))
        added = _legacy_added_tokens(folder, config, json_added_tokens)
    config = _convert_added_tokens(config)                                         # step 5
    by_text = {str(t): t for t in added.values()}
    for name in STANDARD_SPECIAL:
        if config.get(name) is not None and by_text:
            config[name] = by_text.get(str(config[name]), config[name])
    if "additional_special_tokens" in config and "extra_special_tokens" not in config:
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    if json_pad_token is not None:
        config.setdefault("pad_token", json_pad_token)
    auto = {key: value for key, value in config.items() if _is_model_specific(key, value, (str, AddedToken))}
    special = {name: config[name] for name in STANDARD_SPECIAL if config.get(name) is not None}
    special.update({key: value for key, value in {**auto, **explicit}.items() if value is not None})   # step 6
    return _settings(config, special, added)


def _config_with_templates(folder: str) -> dict[str, Any]:
    config = read_json(os.path.join(folder, "tokenizer_config.json")) or {}
    for key in ("tokenizer_class", "init_inputs", "add_bos_token", "add_eos_token"):
        config.pop(key, None)
    templates = _chat_template_files(folder)
    if templates:
        config["chat_template"] = templates["default"] if list(templates) == ["default"] else templates
    return config


def _pop_model_specific(config: dict[str, Any]) -> dict[str, Any]:
    if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    tokens = {key: config.pop(key) for key in list(config) if _is_model_specific(key, config[key], (str,))}
    if isinstance(config.get("extra_special_tokens"), dict):
        tokens.update(config.pop("extra_special_tokens"))
    return tokens or config.pop("model_specific_special_tokens", None) or {}


def _settings(config: dict[str, Any], special: dict[str, Any], added: dict[int, AddedToken]) -> TokenizerSettings:
    template = config.get("chat_template")
    if isinstance(template, (list, tuple)):        # [{"name": ..., "template": ...}, ...]
        template = {t["name"]: t["template"] for t in template}
    return TokenizerSettings(
        special=special, extra_special=list(config.get("extra_special_tokens") or []), added_tokens=added,
        chat_template=template,
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        clean_up_bpe=bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)),
        split_special_tokens=bool(config.get("split_special_tokens", False)),
        model_max_length=config.get("model_max_length") or VERY_LARGE_INTEGER)


def _is_model_specific(key: str, value: Any, types: tuple[type, ...]) -> bool:
    return key.endswith("_token") and key not in STANDARD_SPECIAL and isinstance(value, types)


def _chat_template_files(folder: str) -> dict[str, str]:
    templates = {}
    paths = [("default", os.path.join(folder, "chat_template.jinja"))]
    paths += [(os.path.basename(p).removesuffix(".jinja"), p)
              for p in sorted(glob.glob(os.path.join(folder, "additional_chat_templates", "*.jinja")))]
    for name, path in paths:
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as fh:
                templates[name] = fh.read()
    return templates


def _merge_special_tokens_map(folder: str, config: dict[str, Any]) -> dict[str, Any]:
    """Merge special_tokens_map.json into `config` (it wins); returns the model-specific tokens it names."""
    for key, value in (read_json(os.path.join(folder, "special_tokens_map.json")) or {}).items():
        if isinstance(value, dict) and key != "extra_special_tokens":
            value.pop("special", None)
            value = AddedToken(**value, special=True)
        elif key == "extra_special_tokens" and isinstance(value, list):
            merged = list(config.get("extra_special_tokens") or [])
            for token in value:
                token = AddedToken(**token, special=True) if isinstance(token, dict) else token
                if token not in merged:
                    merged.append(token)
            value = merged
        config[key] = value
    extra = config.get("extra_special_tokens")
    return config.pop("extra_special_tokens") if isinstance(extra, dict) else {}


def _legacy_added_tokens(folder: str, config: dict[str, Any],
                         json_added_tokens: dict[int, AddedToken]) -> dict[int, AddedToken]:
    added: dict[int, AddedToken] = {}
    legacy = read_json(os.path.join(folder, "added_tokens.json"))
    if legacy:
        special = {str(config[k]) for k in STANDARD_SPECIAL if config.get(k)}
        special |= {str(t) for t in config.get("extra_special_tokens") or []}
        for text, index in legacy.items():
            is_special = text in special
            added[index] = AddedToken(text, rstrip=False, lstrip=False, normalized=not is_special, special=is_special)
    added.update(json_added_tokens)
    return added


def _convert_added_tokens(obj: Any) -> Any:
    if isinstance(obj, dict) and obj.get("__type") == "AddedToken":
        return AddedToken(**{k: v for k, v in obj.items() if k != "__type"})
    if isinstance(obj, (list, tuple)):
        return [_convert_added_tokens(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _convert_added_tokens(v) for k, v in obj.items()}
    return obj


def read_json(path: str) -> Optional[Any]:
    """The parsed JSON file, or None when it does not exist."""
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)
