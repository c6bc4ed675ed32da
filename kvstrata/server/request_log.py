"""`--log-requests`: one log line when a request arrives and one when each of its sequences ends.

`--log-requests-level` (SGLang's levels): 0 ids, lengths and outcome; 1 adds the sampling params;
2 adds the first 200 characters of input and output; 3 the whole input and output.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from kvstrata.args import ServerArgs

logger = logging.getLogger("kvstrata.requests")
PREVIEW_CHARS = 200


class RequestLog:
    """Writes request lines to the `kvstrata.requests` logger (at INFO) when enabled."""

    def __init__(self, args: ServerArgs):
        self.enabled = args.log_requests
        self.level = args.log_requests_level
        if self.enabled and logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)   # asked for explicitly: show them whatever --log-level says

    def submitted(self, req: Any, states: list) -> None:
        """A request was accepted: its sequences' rids, prompt lengths and (by level) params and input."""
        if not self.enabled:
            return
        for s in states:
            parts = [f"rid={s.rid}", f"prompt_tokens={len(s.input_ids)}", f"stream={req.stream}"]
            if self.level >= 1:
                parts.append(f"sampling={_nondefault(s.sampling)}")
            if self.level >= 2:
                prompt = req.prompts[s.prompt_index]
                text = prompt.text if prompt.text is not None else str(s.input_ids)
                parts.append(f"input={self._clip(text)!r}")
            logger.info("request received: %s", " ".join(parts))

    def released(self, s: Any) -> None:
        """A sequence ended (finished, failed or aborted by its client)."""
        if not self.enabled:
            return
        outcome = s.finish_reason if s.finished else {"type": "abort", "message": "client went away"}
        parts = [f"rid={s.rid}", f"finish={outcome}", f"prompt_tokens={s.prompt_tokens}",
                 f"completion_tokens={s.completion_tokens}", f"cached_tokens={s.cached_tokens}",
                 f"e2e_latency={s.e2e_latency:.3f}s"]
        if self.level >= 2:
            parts.append(f"output={self._clip(s.text)!r}")
        logger.info("request finished: %s", " ".join(parts))

    def _clip(self, text: str) -> str:
        return text if self.level >= 3 else text[:PREVIEW_CHARS]


def _nondefault(sampling: Any) -> dict:
    """The sampling fields that differ from their defaults (a short, readable summary)."""
    default = type(sampling)()
    return {f.name: getattr(sampling, f.name) for f in dataclasses.fields(sampling)
            if getattr(sampling, f.name) != getattr(default, f.name)}
