"""Tokenizer loading (local folders only), chat templates, and streaming (incremental) detokenization."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Files of which at least one must be present for a folder to hold a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Prompt tokens kept as decoding context for the first generated tokens (leading spaces, byte merges).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class TokenizerLoadError(RuntimeError):
    """The tokenizer files of a folder are missing or cannot be loaded."""


class ChatTemplateError(ValueError):
    """The messages cannot be rendered with the tokenizer's chat template (a client error)."""


def load_tokenizer(path: str, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local HF folder (or of a built-in model name); never touches the hub.

    `chat_template`: a `--chat-template` value (file or built-in name) replacing the tokenizer's own.
    """
    from transformers import AutoTokenizer

    folder = _tokenizer_folder(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises many types (OSError, ValueError, JSON and Rust errors)
        raise TokenizerLoadError(f"cannot load the tokenizer in {folder!r}: {type(e).__name__}: {e}") from e
    return _with_chat_template(tokenizer, chat_template)


def load_light_tokenizer(path: str, chat_template: str | None = None) -> Any:
    """Like load_tokenizer, for a process that should not import torch: a LightTokenizer (transformers' results,
    without transformers) when the folder has a tokenizer.json, else transformers' tokenizer (imports torch)."""
    from kvstrata.model.light_tokenizer import LightTokenizer

    folder = _tokenizer_folder(path)
    if not LightTokenizer.can_load(folder):
        return load_tokenizer(folder, chat_template)
    try:
        tokenizer = LightTokenizer.from_folder(folder)
    except Exception as e:  # JSON, Rust and file errors
        raise TokenizerLoadError(f"cannot load the tokenizer in {folder!r}: {type(e).__name__}: {e}") from e
    return _with_chat_template(tokenizer, chat_template)


def load_checked_tokenizer(path: str) -> Any:
    """The scheduler's tokenizer: a LightTokenizer where transformers' tokenizer of the folder has been recorded
    with the same fingerprint (tokenizer_check.py), else transformers' tokenizer. Both give transformers' results;
    the LightTokenizer keeps transformers' model-config imports (~100 MB of RSS) out of the process."""
    from kvstrata.model.light_tokenizer import LightTokenizer, fingerprint
    from kvstrata.model.tokenizer_check import recorded_fingerprint

    folder = _tokenizer_folder(path)
    recorded = recorded_fingerprint(folder) if LightTokenizer.can_load(folder) else None
    if recorded is not None:
        tokenizer = load_light_tokenizer(folder)
        if fingerprint(tokenizer) == recorded:
            return tokenizer
        logger.info("transformers loads the tokenizer in %r differently from tokenizer.json (a model-specific "
                    "class?): the scheduler uses transformers' tokenizer", folder)
    return load_tokenizer(folder)


def confirm_light_tokenizer(tokenizer: Any, fingerprint: str, path: str, chat_template: str | None = None) -> Any:
    """`tokenizer`, unless it is a LightTokenizer whose fingerprint differs from `fingerprint` (that of the
    scheduler's tokenizer for the same folder: transformers' where its class is model-specific): then
    transformers' tokenizer."""
    from kvstrata.model.light_tokenizer import LightTokenizer
    from kvstrata.model.light_tokenizer import fingerprint as fingerprint_of

    if not isinstance(tokenizer, LightTokenizer) or fingerprint_of(tokenizer) == fingerprint:
        return tokenizer
    logger.warning("transformers loads the tokenizer in %r differently from tokenizer.json (a model-specific "
                   "class?): using transformers' tokenizer, which loads torch into this process", path)
    return load_tokenizer(path, chat_template)


def has_tokenizer_files(folder: str) -> bool:
    """Whether `folder` holds at least one of the files a tokenizer is loaded from."""
    return any(os.path.isfile(os.path.join(folder, name)) for name in _TOKENIZER_FILES)


def _tokenizer_folder(path: str) -> str:
    from kvstrata.model.builtin import resolve_model_path

    folder = resolve_model_path(path)
    if not os.path.isdir(folder):
        raise TokenizerLoadError(f"tokenizer folder {folder!r} does not exist (only local folders are supported)")
    if not has_tokenizer_files(folder):
        raise TokenizerLoadError(f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {folder!r}")
    return folder


def _with_chat_template(tokenizer: Any, chat_template: str | None) -> Any:
    if chat_template is not None:
        from kvstrata.model.chat_template_flag import resolve_chat_template

        tokenizer.chat_template = resolve_chat_template(chat_template)
    return tokenizer


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> str:
    """Render messages into a prompt string with the tokenizer's chat template.

    OpenAI-style content parts (`[{"type": "text", "text": ...}]`) are joined into one string. With
    `continue_final_message` the prompt ends inside the last message (no end-of-turn, no generation prompt).
    `template_kwargs` are extra variables for the template (the API's `chat_template_kwargs`).
    Raises ChatTemplateError on anything the template or the messages do not allow.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the model's tokenizer has no chat template")
    rendered_messages = [_flatten_content(m) for m in messages]
    try:
        prompt = tokenizer.apply_chat_template(
            rendered_messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(template_kwargs or {}),   # e.g. enable_thinking for Qwen3's template
        )
    except Exception as e:  # jinja2 TemplateError (raise_exception in templates), ValueError, TypeError
        raise ChatTemplateError(f"cannot apply the chat template: {e}") from e
    return prompt


def _flatten_content(message: dict) -> dict:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            texts.append(str(part.get("text", "")))
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatTemplateError(f"unsupported content part type {kind!r}: only text parts are supported")
    return {**message, "content": "".join(texts)}


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, never emitting half of a UTF-8 character.

    Decodes a short window instead of all ids: the window starts `prefix` tokens back, at the start
    of the last emitted chunk, so the decoder sees the same context as a full decode would (byte-level
    merges, leading spaces). A delta is emitted only once the window's text no longer ends with an
    incomplete character (U+FFFD); emitted text is then final. Each step costs O(window), which stays
    a few tokens long, so streaming is amortized O(1) per token.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._decode_kwargs: dict[str, Any] = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT):
            # The prompt ends inside a character: decode the output on its own rather than subtract a
            # prefix whose last character the output would rewrite.
            context, context_text = [], ""
        self._window: list[int] = context  # ids from the prefix offset on
        self._read = len(context)  # window index where the not-yet-emitted ids start
        self._prefix_text = context_text  # decode(window[:read])
        self._chunks: list[str] = []
        self._num_ids = 0

    def add(self, new_ids: list[int]) -> str:
        """Append generated ids; return the newly finalized text (may be empty)."""
        if not new_ids:
            return ""
        self._window.extend(new_ids)
        self._num_ids += len(new_ids)
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""  # nothing visible yet, or a character still waits for its remaining bytes
        return self._emit(text)

    def flush(self) -> str:
        """Emit whatever is held back (text ending in an incomplete character), e.g. when generation ends."""
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text):
            return ""
        return self._emit(text)

    def _emit(self, text: str) -> str:
        delta = text[len(self._prefix_text):]
        self._chunks.append(delta)
        # The emitted chunk becomes the next window's context.
        del self._window[: self._read]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def num_ids(self) -> int:
        """Number of generated ids added so far."""
        return self._num_ids

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, **self._decode_kwargs) if ids else ""
