"""Chat template rendering with transformers 5's semantics, without transformers.

The environment is transformers': a sandboxed (immutable) Jinja environment with trim_blocks, lstrip_blocks,
loop controls and the `{% generation %}` tag; a `tojson` filter that does not escape HTML (ensure_ascii=False,
optional indent / separators / sort_keys); globals `raise_exception`, `strftime_now` and restricted `dict` and
`namespace`. The template sees `messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens
(bos_token, eos_token, ...) and the caller's extra variables.

Messages are copied as plain JSON data, keys whose value is None are dropped, and a message's reasoning is also
visible as `reasoning_content` and `thinking`. `continue_final_message` tags the end of the last message's
content, renders, and cuts the prompt at the tag, so the prompt ends inside that message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional, Union

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat(template: str, messages: list[dict], tools: Optional[list[dict]] = None,
                documents: Optional[list[dict]] = None, add_generation_prompt: bool = False,
                continue_final_message: Union[bool, str] = False, **variables: Any) -> str:
    """The prompt text of one conversation; raises ValueError / TypeError / jinja2 errors as transformers does."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    compiled = _compile(template)
    if tools is not None and not all(isinstance(tool, dict) for tool in tools):
        raise ValueError("Tools should be JSON schemas (dicts)")
    if documents is not None and not all(isinstance(doc, dict) for doc in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = [_plain(_without_none(message)) for message in messages]
    chat = [_alias_reasoning(message) for message in chat]
    final = _tag_final_message(chat, template, continue_final_message) if continue_final_message else ""
    rendered = compiled.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                               add_generation_prompt=add_generation_prompt, **_plain(variables))
    return _cut_at_tag(rendered, final) if continue_final_message else rendered


def _without_none(message: Any) -> dict:
    if not isinstance(message, dict):
        raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
    # Many templates render a literal "None" for content=None but handle a missing key.
    return {key: value for key, value in message.items() if value is not None}


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final_message(chat: list[dict], template: str, field: Union[bool, str]) -> str:
    """Append the tag to the last message's `field` (content by default); returns the text to continue."""
    field = field if isinstance(field, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    fields = [field]
    if field in _REASONING_FIELDS:     # reasoning is copied under several names: tag every copy
        fields = [name for name in _REASONING_FIELDS if chat[-1].get(name) == final]
    if not any(name in template for name in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the '
                         f'chat_template')
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:       # the last text block
                final = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                return final
        raise ValueError("continue_final_message is set but we could not find any text to continue in the final "
                         "message!")
    for name in fields:
        chat[-1][name] = chat[-1][name] + _CONTINUE_TAG
    return final


def _cut_at_tag(rendered: str, final: str) -> str:
    if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat after "
                         "applying the chat template")
    at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()    # the template trimmed the message's trailing space


def _plain(value: Any) -> Any:
    """A copy made of plain JSON types only (the sandbox does not know what other objects' methods do)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return f"<{type(value).__name__}>"


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict(...)` for templates, without attribute access to the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attributes (no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]     # Jinja's signature trick, so that `namespace(self=...)` works
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    return env.from_string(template)
