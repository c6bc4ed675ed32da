"""Tool calls in chat completions: parse them out of the model's text, whole or while it streams.

Formats (`--tool-call-parser`, or inferred from the chat template):
- hermes (also qwen, qwen25, qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
  text before the first one is the message content;
- llama3: the whole reply is a JSON object `{"name": ..., "parameters": {...}}` (several joined by `;`).

A forced call (`tool_choice: "required"` or a named function) is generated under a JSON schema
(`forced_call_schema`), so its text is exactly one call object in the parser's own shape.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments (a JSON value, usually an object)."""

    name: str
    arguments: Any
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self, index: Optional[int] = None) -> dict:
        """The OpenAI `tool_calls` entry (streaming deltas carry an `index`)."""
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}
        if index is not None:
            out["index"] = index
        return out


class ToolCallParser:
    """Finds calls in a reply. `start`: the text that opens a call; `end`: the one that closes it (or None:
    the call runs to the end of the reply); `only_at_start`: a call may only open the reply."""

    name = ""
    arguments_key = "arguments"
    start = ""
    end: Optional[str] = None
    only_at_start = False

    def __init__(self, tool_names: set[str]):
        self.tool_names = tool_names

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole reply; text that does not parse as a call stays content."""
        streamer = ToolCallStreamer(self)
        content, calls = streamer.feed(text)
        more_content, more_calls = streamer.finish()
        return content + more_content, calls + more_calls

    def parse_forced(self, text: str) -> list[ToolCall]:
        """The call of a reply generated under `forced_call_schema` (empty if it did not complete)."""
        return self._calls_in(text)

    def _calls_in(self, body: str) -> list[ToolCall]:
        """The calls of one call's text (llama3: possibly several joined by ';'); [] if any is malformed."""
        calls = []
        for piece in self._pieces(body):
            try:
                obj = json.loads(piece)
            except json.JSONDecodeError:
                return []
            call = self._call_from(obj)
            if call is None:
                return []
            calls.append(call)
        return calls

    def _pieces(self, body: str) -> list[str]:
        return [body.strip()]

    def _call_from(self, obj: Any) -> Optional[ToolCall]:
        if not isinstance(obj, dict) or obj.get("name") not in self.tool_names:
            return None
        args = obj.get(self.arguments_key, obj.get("arguments", obj.get("parameters", {})))
        if isinstance(args, str):       # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        return ToolCall(obj["name"], args)


class HermesParser(ToolCallParser):
    """Qwen 2.5 / Qwen 3 / Hermes: `<tool_call>` JSON `</tool_call>`."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"


class Llama3Parser(ToolCallParser):
    """Llama 3.x JSON tool calls: the reply is `{"name": ..., "parameters": ...}` (`;`-separated)."""

    name = "llama3"
    arguments_key = "parameters"
    start = "{"
    only_at_start = True

    def _pieces(self, body: str) -> list[str]:
        text = body.strip()
        if _is_json(text):
            return [text]
        return [p for p in (s.strip() for s in text.split(";")) if p]


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "qwen": HermesParser,
                                            "qwen25": HermesParser, "qwen3": HermesParser,
                                            "llama3": Llama3Parser}


def select_parser(flag: Optional[str], chat_template: Optional[str], tools: list[dict]) -> ToolCallParser:
    """The parser for a request's tools: the flag's, else the one the chat template's format suggests."""
    names = {t["function"]["name"] for t in tools}
    if flag:
        return PARSERS[flag](names)
    template = chat_template or ""
    if "<tool_call>" not in template and ("<|start_header_id|>" in template or '"parameters"' in template):
        return Llama3Parser(names)
    return HermesParser(names)


def forced_call_schema(tools: list[dict], name: Optional[str], parser: ToolCallParser) -> dict:
    """JSON schema of one call object to `name` (None: to any of `tools`), in the parser's shape."""
    options = []
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]},
                                                         parser.arguments_key: params},
                        "required": ["name", parser.arguments_key]})
    return options[0] if len(options) == 1 else {"anyOf": options}


class ToolCallStreamer:
    """Splits a reply arriving in pieces into content deltas and complete calls.

    Text that could still become the start of a call is held back (as stop strings are), so a call's
    markup never reaches the content; a call is emitted whole once its closing text (or the reply's
    end) arrives. Text inside a call that does not parse is given back as content at the end.
    """

    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self.buffer = ""          # text not yet given out
        self.in_call = False
        self.seen_text = False    # anything but whitespace given out or buffered before (llama3)
        self.calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Content that is safe to show now, and the calls completed by `delta`."""
        self.buffer += delta
        content, calls = "", []
        while True:
            if self.in_call:
                end = self.parser.end
                pos = self.buffer.find(end) if end else -1
                if pos < 0:
                    return content, calls
                found = self.parser._calls_in(self.buffer[:pos])
                if not found:       # not a call after all: show it as it was written
                    content += self.parser.start + self.buffer[:pos + len(end)]
                calls += found
                self.calls += len(found)
                self.buffer, self.in_call = self.buffer[pos + len(end):], False
                continue
            pos = self._start_pos()
            if pos is None:
                keep = _partial_suffix_len(self.buffer, self.parser.start)
                if self.parser.only_at_start and not self.seen_text and not self.buffer.strip():
                    keep = len(self.buffer)
                safe, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                self.seen_text = self.seen_text or bool(safe.strip())
                return content + self._visible(safe), calls
            content += self._visible(self.buffer[:pos])
            self.buffer, self.in_call = self.buffer[pos + len(self.parser.start):], True

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the reply's end: a call without closing text is parsed as it is; leftovers are content."""
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return rest, []
        self.in_call = False
        body = rest
        if self.parser.end:       # cut short inside its closing tag: the call itself may be whole
            body = rest[:len(rest) - _partial_suffix_len(rest, self.parser.end)]
        calls = self.parser._calls_in(self.parser.start + body if self.parser.start == "{" else body)
        return ("", calls) if calls else (self.parser.start + rest, [])

    def _visible(self, text: str) -> str:
        """Whitespace around and between calls is layout, not content."""
        return text if text.strip() or not self.calls else ""

    def _start_pos(self) -> Optional[int]:
        start = self.parser.start
        if self.parser.only_at_start:
            if self.seen_text:
                return None
            stripped = self.buffer.lstrip()
            return len(self.buffer) - len(stripped) if stripped.startswith(start) else None
        pos = self.buffer.find(start)
        return pos if pos >= 0 else None


def _partial_suffix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


class ForcedCallStreamer:
    """The streamer of a forced call: the reply is one JSON call, given out when the reply ends."""

    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self.buffer = ""

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Nothing to show until the call is complete."""
        self.buffer += delta
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The call (or, if generation stopped short of one, the raw text as content)."""
        calls = self.parser.parse_forced(self.buffer)
        return ("", calls) if calls else (self.buffer, [])


def new_streamer(parser: ToolCallParser, forced: bool) -> ToolCallStreamer | ForcedCallStreamer:
    """The streamer for a reply: forced (one JSON call) or free text with calls in the parser's markup."""
    return ForcedCallStreamer(parser) if forced else ToolCallStreamer(parser)
