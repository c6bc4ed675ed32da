"""Role segments from the model's own chat template, so that a program's text equals the template's output.

A role's prefix and suffix are found by rendering the conversation so far with and without one more
message whose content is a sentinel: what the template adds before the sentinel is the prefix, what it
adds after is the suffix. Rendering with the real history keeps templates whose markup depends on
position (a default system prompt before the first message, a BOS token) exact.
"""

from __future__ import annotations

from typing import Any, Optional

_SENTINEL = "KVSTRATA-ROLE-CONTENT-5b1e"
# Stand-in conversations for templates that refuse the real history (e.g. strict role alternation).
_PLACEHOLDER_HISTORY = {"system": [], "user": [], "assistant": [{"role": "user", "content": "x"}]}


class ChatTemplateError(ValueError):
    """The chat template cannot render a role segment (or the model has no chat template)."""


class RoleRenderer:
    """Computes (prefix, suffix) of a role segment with a tokenizer's chat template."""

    def __init__(self, tokenizer: Any, chat_template: Optional[str] = None):
        self._tokenizer = tokenizer
        self._template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self._template:
            raise ChatTemplateError("the model's tokenizer has no chat template: system/user/assistant roles "
                                    "need one (pass chat_template=... to the backend, or use plain text)")
        # The backends tokenize like SGLang's server (special tokens added), so a BOS that the template
        # writes would appear twice: leave it out of the text and let tokenization add it.
        self._bos_to_strip = _auto_bos_text(tokenizer)

    def segment(self, role: str, history: list[dict]) -> tuple[str, str]:
        """(prefix, suffix) of a `role` message that follows `history` (the messages so far)."""
        errors = []
        for hist in (history, _PLACEHOLDER_HISTORY.get(role, [])):
            try:
                prefix, suffix = self._segment_after(role, hist)
            except ChatTemplateError as e:
                errors.append(str(e))
                continue
            if self._bos_to_strip and prefix.startswith(self._bos_to_strip):
                prefix = prefix[len(self._bos_to_strip):]
            return prefix, suffix
        raise ChatTemplateError(f"the chat template cannot render a {role!r} message after "
                                f"{[m['role'] for m in history]}: {errors[0]}")

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's rendering of whole messages (what `state.text()` should equal)."""
        try:
            return self._tokenizer.apply_chat_template(messages, tokenize=False, chat_template=self._template,
                                                       add_generation_prompt=add_generation_prompt)
        except Exception as e:   # jinja2 errors, raise_exception() in templates, ValueError from transformers
            raise ChatTemplateError(f"{type(e).__name__}: {e}") from e

    def _segment_after(self, role: str, history: list[dict]) -> tuple[str, str]:
        full = self.render([*history, {"role": role, "content": _SENTINEL}])
        base = self.render(history) if history else ""
        if not full.startswith(base) or full.count(_SENTINEL) != 1:
            raise ChatTemplateError("the template rewrites earlier messages when one is added")
        added = full[len(base):]
        at = added.index(_SENTINEL)
        return added[:at], added[at + len(_SENTINEL):]


def _auto_bos_text(tokenizer: Any) -> str:
    """The BOS token text when tokenizing with special tokens prepends it, else ''."""
    bos, bos_id = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "bos_token_id", None)
    if not bos or bos_id is None:
        return ""
    try:
        ids = tokenizer.encode("a", add_special_tokens=True)
    except Exception:
        return ""
    return bos if ids and ids[0] == bos_id else ""
