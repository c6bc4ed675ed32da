"""LightTokenizer: what transformers makes of a folder with `tokenizer.json`, without importing transformers.

`from transformers import AutoTokenizer` imports torch (~220 MB of RSS), which the HTTP process otherwise
never needs. This class rebuilds, with the `tokenizers` library alone, the generic `TokenizersBackend`
that `AutoTokenizer.from_pretrained` (transformers 5) loads for such a folder:

    tokenizer.json                 -> the Rust tokenizer, as is
    tokenizer_config.json          -> named special tokens (bos ... mask, model-specific `*_token`), extra
      (+ special_tokens_map.json,     special tokens, added tokens re-added in transformers' order,
         added_tokens.json when it     clean_up_tokenization_spaces, split_special_tokens; add_bos_token /
         has no added_tokens_decoder)  add_eos_token are ignored, as transformers ignores them here
    chat_template.jinja, additional_chat_templates/*.jinja, tokenizer_config's chat_template -> chat_template

Model-specific classes (Qwen2Tokenizer, LlamaTokenizer, ...) rebuild the pipeline in Python instead.
`fingerprint()` tells the two apart: transformers' fingerprint of the folder is recorded at server start
(tokenizer_check.py); the scheduler uses this class only where its fingerprint equals that record, and reports
the fingerprint of the tokenizer it holds; the HTTP process falls back to transformers when it differs from
this class's.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Optional, Union

from tokenizers import AddedToken, Tokenizer, processors

from kvstrata.model.chat_render import render_chat
from kvstrata.model.tokenizer_settings import STANDARD_SPECIAL, TokenizerSettings, read_json, read_settings

EMULATED_CLASS = "TokenizersBackend"
_TOKENIZER_JSON = "tokenizer.json"


class LightTokenizer:
    """encode / decode / vocabulary / special tokens / chat template with transformers' results."""

    is_fast = True

    def __init__(self, backend: Tokenizer, settings: TokenizerSettings, name_or_path: str = ""):
        self._backend = backend
        # Named special token -> its text (standard names first, then model-specific ones).
        self._special = {name: str(token) for name, token in settings.special.items()}
        self._extra_special = [str(token) for token in settings.extra_special]
        self.chat_template: Union[str, dict[str, str], None] = settings.chat_template
        self.clean_up_tokenization_spaces = settings.clean_up_tokenization_spaces
        self.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = settings.clean_up_bpe
        self.split_special_tokens = settings.split_special_tokens
        self.model_max_length = settings.model_max_length
        self.name_or_path = name_or_path

    @staticmethod
    def can_load(folder: str) -> bool:
        """Whether the folder has a tokenizer.json this class reads as transformers would."""
        if not os.path.isfile(os.path.join(folder, _TOKENIZER_JSON)):
            return False
        config = read_json(os.path.join(folder, "tokenizer_config.json")) or {}
        # Versioned tokenizer files and remote code are transformers' business.
        return "fast_tokenizer_files" not in config and "auto_map" not in config

    @classmethod
    def from_folder(cls, folder: str) -> LightTokenizer:
        """Load the tokenizer of a local folder that `can_load`."""
        backend = Tokenizer.from_file(os.path.join(folder, _TOKENIZER_JSON))
        pad_token = backend.padding["pad_token"] if backend.padding is not None else None
        settings = read_settings(folder, backend.get_added_tokens_decoder(), pad_token)
        # Encoding never truncates or pads, as with transformers' defaults.
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = settings.split_special_tokens
        had_post_processor = backend.post_processor is not None
        backend.add_tokens(_tokens_to_add(backend, settings))
        if not had_post_processor:
            # transformers' update_post_processor() without add_bos_token / add_eos_token.
            backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
        return cls(backend, settings, folder)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with the post-processor's special tokens when `add_special_tokens`)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Union[int, list[int]], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: Optional[bool] = None, spaces_between_special_tokens: bool = True) -> str:
        """Text of `token_ids`; `spaces_between_special_tokens` is accepted and ignored, as transformers' fast
        tokenizers do."""
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if clean and (type(self._backend.model).__name__ != "BPE"
                      or self.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output):
            text = _clean_up_tokenization(text)
        return text

    def convert_tokens_to_ids(self, tokens: Union[str, list[str]]) -> Union[Optional[int], list[Optional[int]]]:
        """Id of each token (the unk token's id for unknown ones)."""
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: Union[int, list[int]], skip_special_tokens: bool = False):
        """Vocabulary spelling of each id."""
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def _token_id(self, token: str) -> Optional[int]:
        token_id = self._backend.token_to_id(token)
        if token_id is None and "unk_token" in self._special:
            token_id = self._backend.token_to_id(self._special["unk_token"])
        return token_id

    # ------------------------------------------------------------------ vocabulary and special tokens
    def get_vocab(self) -> dict[str, int]:
        """Token text -> id, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Size of the base vocabulary (without added tokens)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend_tokenizer(self) -> Tokenizer:
        """The Rust tokenizer."""
        return self._backend

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        """Id -> added token (content and flags)."""
        return self._backend.get_added_tokens_decoder()

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special tokens (bos_token, eos_token, ..., model-specific ones) -> their text."""
        return dict(self._special)

    @property
    def all_special_tokens(self) -> list[str]:
        """Named then extra special tokens, without repeats."""
        return list(dict.fromkeys([*self._special.values(), *self._extra_special]))

    @property
    def all_special_ids(self) -> list[Optional[int]]:
        """Ids of all_special_tokens."""
        return [self._token_id(t) for t in self.all_special_tokens]

    def __getattr__(self, name: str) -> Any:
        # bos_token, eos_token_id, image_token, ...: None for a standard name the tokenizer does not set.
        base = name.removesuffix("_id")
        special = self.__dict__.get("_special", {})
        if base not in special and base not in STANDARD_SPECIAL:
            raise AttributeError(name)
        token = special.get(base)
        return token if token is None or base == name else self._token_id(token)

    # ------------------------------------------------------------------ chat template
    def get_chat_template(self, chat_template: Optional[str] = None, tools: Optional[list] = None) -> str:
        """The template to render with: `chat_template` (a template or the name of one), else the tokenizer's."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in own:
                    return own["tool_use"]
                if "default" in own:
                    return own["default"]
                raise ValueError(f"This model has multiple chat templates with no default specified: {sorted(own)}")
        if chat_template is None:
            if own is None:
                raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")
            return own
        return chat_template

    def apply_chat_template(self, conversation: list[dict], tools: Optional[list[dict]] = None,
                            documents: Optional[list[dict]] = None, chat_template: Optional[str] = None,
                            add_generation_prompt: bool = False, continue_final_message: Union[bool, str] = False,
                            tokenize: bool = False, **kwargs: Any) -> str:
        """Render one conversation to text, as transformers' apply_chat_template(..., tokenize=False) does."""
        if tokenize:
            raise ValueError("LightTokenizer renders chat templates to text only (tokenize=False)")
        template = self.get_chat_template(chat_template, tools)
        return render_chat(template, conversation, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                           **{**self.special_tokens_map, **kwargs})


def fingerprint(tokenizer: Any) -> str:
    """Digest of what decides a tokenizer's encode / decode / special tokens, for transformers' tokenizers and
    LightTokenizer alike. Equal digests mean equal results: the vocabulary itself is not hashed, but both read
    it unchanged from tokenizer.json when the class is the generic one, and the class is hashed. Empty for a
    tokenizer without a Rust backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return ""
    components = (backend.normalizer, backend.pre_tokenizer, backend.post_processor, backend.decoder)
    added = sorted(backend.get_added_tokens_decoder().items())
    state = {
        "class": EMULATED_CLASS if isinstance(tokenizer, LightTokenizer) else type(tokenizer).__name__,
        "model": type(backend.model).__name__,
        "components": [c.__getstate__().decode() if c is not None else None for c in components],
        "added": [[i, t.content, t.special, t.lstrip, t.rstrip, t.normalized, t.single_word] for i, t in added],
        "size": backend.get_vocab_size(with_added_tokens=True),
        "encode_special_tokens": backend.encode_special_tokens,
        "special": tokenizer.special_tokens_map,
        "all_special": tokenizer.all_special_tokens,
        "clean_up": [bool(tokenizer.clean_up_tokenization_spaces), bool(getattr(
            tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))],
    }
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def _tokens_to_add(backend: Tokenizer, settings: TokenizerSettings) -> list[AddedToken]:
    """The tokens TokenizersBackend.__init__ adds: every configured added token (its duplicate check compares
    ids with tokens, so it never matches), then the special tokens the tokenizer does not know yet."""
    tokens: list[Any] = [token for _, token in sorted(settings.added_tokens.items())]
    known = [t.content for _, t in sorted(backend.get_added_tokens_decoder().items())] + [str(t) for t in tokens]
    for token in [*settings.special.values(), *settings.extra_special]:
        if str(token) not in known:
            tokens.append(token)
            known.append(str(token))
    named = {str(t) for t in settings.special.values()}
    result = []
    for token in tokens:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and str(token) in named:
            token.special = True
        result.append(token)
    return result


def _clean_up_tokenization(text: str) -> str:
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
