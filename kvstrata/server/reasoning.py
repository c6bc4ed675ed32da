"""`--reasoning-parser`: chat replies split into `reasoning_content` (between `<think>` and `</think>`) and
`content`, whole or while they stream.

deepseek-r1 (whose template opens `<think>` in the prompt) treats a reply as reasoning from its first
character until `</think>`; every other name (qwen3, ...) only when the reply opens with `<think>`.
"""

from __future__ import annotations

from kvstrata.server.tool_calls import partial_marker_len

START, END = "<think>", "</think>"
# Parsers whose replies begin inside the reasoning block (the template wrote `<think>`).
STARTS_IN_REASONING = {"deepseek-r1", "deepseek-v3"}


class ReasoningStreamer:
    """Feeds reply text in pieces; hands out (reasoning, content) deltas; marker text never leaks."""

    def __init__(self, parser_name: str):
        self.buffer = ""
        self.state = "reasoning" if parser_name in STARTS_IN_REASONING else "undecided"
        self.strip_content = False     # the line break after </think> is layout, not content

    def feed(self, delta: str) -> tuple[str, str]:
        """The reasoning and content safe to show after `delta`."""
        self.buffer += delta
        reasoning = content = ""
        if self.state == "undecided":
            stripped = self.buffer.lstrip()
            if stripped.startswith(START):
                self.state, self.buffer = "reasoning", stripped[len(START):]
            elif START.startswith(stripped):
                return "", ""                     # could still open with <think>
            else:
                self.state = "content"
        if self.state == "reasoning":
            pos = self.buffer.find(END)
            if pos < 0:
                keep = partial_marker_len(self.buffer, END)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning, self.buffer = self.buffer[:pos], self.buffer[pos + len(END):]
            self.state, self.strip_content = "content", True
        content, self.buffer = self.buffer, ""
        if self.strip_content:
            content = content.lstrip()
            self.strip_content = not content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is left at the end of the reply (an unclosed block stays reasoning)."""
        rest, self.buffer = self.buffer, ""
        return (rest, "") if self.state == "reasoning" else ("", rest)


def split_reasoning(parser_name: str, text: str) -> tuple[str, str]:
    """(reasoning, content) of a whole reply."""
    streamer = ReasoningStreamer(parser_name)
    reasoning, content = streamer.feed(text)
    more_reasoning, more_content = streamer.finish()
    return reasoning + more_reasoning, content + more_content

