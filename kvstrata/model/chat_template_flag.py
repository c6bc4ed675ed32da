"""`--chat-template`: a Jinja file, a JSON file with a `chat_template` key, or a built-in name.

The built-in names are the templates of the built-in models (ChatML and Llama-3 headers, with tools).
"""

from __future__ import annotations

import json
import os

from kvstrata.model.chat_templates import CHATML_TEMPLATE, LLAMA3_TEMPLATE

BUILTIN_TEMPLATES = {"chatml": CHATML_TEMPLATE, "qwen": CHATML_TEMPLATE, "llama-3-instruct": LLAMA3_TEMPLATE,
                     "llama3": LLAMA3_TEMPLATE}


class ChatTemplateNotFound(ValueError):
    """`--chat-template` names neither a readable file nor a built-in template."""


def resolve_chat_template(value: str) -> str:
    """The Jinja text `value` stands for (a file's content, or a built-in template)."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as e:
            raise ChatTemplateNotFound(f"cannot read the chat template file {value!r}: {e}") from e
        if value.endswith(".json"):
            return _from_json(value, text)
        return text
    if value in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[value]
    raise ChatTemplateNotFound(f"--chat-template {value!r} is neither a file nor a built-in template "
                               f"({', '.join(sorted(BUILTIN_TEMPLATES))})")


def _from_json(path: str, text: str) -> str:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ChatTemplateNotFound(f"{path}: not valid JSON: {e}") from e
    template = data.get("chat_template") if isinstance(data, dict) else None
    if not isinstance(template, str):
        raise ChatTemplateNotFound(f"{path}: no 'chat_template' string in the JSON object")
    return template
