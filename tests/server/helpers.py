"""Small client helpers shared by the server tests."""

from __future__ import annotations

import json
import threading
import time
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


def bench_multiturn_body(prompt: str, output_len: int) -> dict:
    """The /generate body SGLang's benchmark/hicache/bench_multiturn.py sends (field for field)."""
    return {
        "text": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
        "stream": True,
        "lora_path": "",
        "return_logprob": False,
        "logprob_start_len": -1,
    }


class HealthProbe:
    """Polls /health in a thread and records the slowest answer."""

    def __init__(self, url: str):
        self.url = url
        self.worst = 0.0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                status = requests.get(self.url + "/health", timeout=5).status_code
                if status != 200:
                    self.failures.append(f"status {status}")
            except requests.RequestException as e:
                self.failures.append(repr(e))
            self.worst = max(self.worst, time.monotonic() - start)
            time.sleep(0.02)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
