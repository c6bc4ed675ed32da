"""Small client helpers shared by the server tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
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
    """Polls /health from a separate process and records the slowest answer and every failure.

    A separate process, because a thread of the test process waits for the GIL whenever the test itself
    holds it (hypothesis generating a case can, for a second or more): that is the test's latency, not
    the server's.
    """

    _POLL = """
import json, os, sys, time, requests
url, out = sys.argv[1], sys.argv[2]
worst, failures, first = 0.0, [], True
while True:
    start = time.monotonic()
    try:
        status = requests.get(url + "/health", timeout=5).status_code
        if status != 200:
            failures.append(f"status {status}")
    except requests.RequestException as e:
        failures.append(repr(e))
    elapsed = time.monotonic() - start
    if elapsed > worst or failures or first:
        first = False
        worst = max(worst, elapsed)
        with open(out + ".tmp", "w") as fh:
            json.dump({"worst": worst, "failures": failures[:20]}, fh)
        os.replace(out + ".tmp", out)
    time.sleep(0.02)
"""

    def __init__(self, url: str):
        self.url = url
        self._out = tempfile.NamedTemporaryFile(prefix="health-probe-", suffix=".json", delete=False).name
        self._process: Optional[subprocess.Popen] = None
        self._final: Optional[dict] = None

    def _state(self) -> dict:
        if self._final is not None:
            return self._final
        try:
            with open(self._out) as fh:
                return json.load(fh)
        except (OSError, ValueError):       # nothing written yet: no answer was slow or failed
            return {"worst": 0.0, "failures": []}

    @property
    def worst(self) -> float:
        """The slowest /health answer so far, in seconds."""
        return float(self._state()["worst"])

    @property
    def failures(self) -> list[str]:
        """Non-200 answers and connection errors so far."""
        return list(self._state()["failures"])

    def __enter__(self) -> HealthProbe:
        self._process = subprocess.Popen([sys.executable, "-c", self._POLL, self.url, self._out])
        deadline = time.monotonic() + 60
        while os.path.getsize(self._out) == 0:      # the first answer is in: the probe is watching
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()                     # `with` does not call it when __enter__ raises
                raise AssertionError("the /health probe did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(10)
        self._final = self._state()
        os.unlink(self._out)
