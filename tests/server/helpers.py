"""Small client helpers shared by the server tests."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Optional

import requests


def sse_events(resp: requests.Response) -> list[Any]:
    """Parse a server-sent-event stream into its JSON payloads, with '[DONE]' kept as a string."""
    return parse_sse(resp.iter_lines(decode_unicode=True))


def parse_sse(lines: Iterable[str]) -> list[Any]:
    """The payloads of SSE `data:` lines (blank separator lines skipped)."""
    events: list[Any] = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def printable_stop(text: str, start: int = 3) -> Optional[str]:
    """A short substring of `text` (at or after `start`) made of printable ASCII, to use as a stop string."""
    for i in range(start, len(text) - 1):
        piece = text[i:i + 2]
        if all(32 < ord(c) < 127 for c in piece):
            return piece
    return None
