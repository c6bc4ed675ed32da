"""The routing key of a request: the prompt's token ids when it carries them, else its text.

Nothing is validated here (the worker does that): a body that is not the expected shape just has no key,
and is routed by load alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Optional

RouteKey = Optional[Sequence]   # tuple[int, ...] (token ids), str (text), or None (no prompt found)


def route_key(path: str, body: bytes) -> RouteKey:
    """The key of a POST to `path` with JSON `body`; for a batch, the key of its first prompt."""
    req = _json_object(body)
    if req is None:
        return None
    if path.endswith("/chat/completions"):
        return _chat_text(req.get("messages"))
    if path.endswith("/completions"):
        return _prompt_key(req.get("prompt"))
    return _prompt_key(req.get("input_ids")) or _prompt_key(req.get("text"))


def session_id(headers: Mapping[str, str], body: bytes) -> Optional[str]:
    """The conversation a request belongs to: `X-Session-ID`, SGLang's `session_params.id`, or OpenAI's
    `user` (None: none given). Only used to keep a conversation on one worker when costs tie."""
    sid = headers.get("x-session-id")
    if sid:
        return sid[:256]
    if b'"session_params"' not in body and b'"user"' not in body:
        return None
    req = _json_object(body)
    if req is None:
        return None
    params = req.get("session_params")
    sid = params.get("id") if isinstance(params, dict) else None
    sid = sid if isinstance(sid, str) and sid else req.get("user")
    return sid[:256] if isinstance(sid, str) and sid else None


def _json_object(body: bytes) -> Optional[dict]:
    """The body as a JSON object, or None (not JSON, or not an object)."""
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return req if isinstance(req, dict) else None


def _prompt_key(prompt: Any) -> RouteKey:
    if isinstance(prompt, str):
        return prompt or None
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int) and not isinstance(first, bool):
            return tuple(t for t in prompt if isinstance(t, int)) or None
        return _prompt_key(first)
    return None


def _chat_text(messages: Any) -> RouteKey:
    """Roles and text contents joined: a stable stand-in for the chat template's output."""
    if not isinstance(messages, list):
        return None
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):   # OpenAI content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role', '')}\n{content if isinstance(content, str) else ''}\n")
    return "".join(parts) or None
