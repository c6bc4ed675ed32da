"""StopChecker: decides after each new token whether a request is finished, and why."""

from __future__ import annotations

import re
from typing import Any, Optional

from kvstrata.runtime.req import Req, finish_length, finish_stop

STOP_WINDOW_EXTRA_TOKENS = 8
REGEX_WINDOW_TOKENS = 64


class StopChecker:
    """eos / stop_token_ids / stop strings / stop_regex / max_new_tokens / context limit / grammar end."""

    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...]):
        """`tokenizer` decodes the tail of an output for stop strings and stop_regex (the scheduler's)."""
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)

    def check(self, req: Req, context_len: int) -> Optional[dict]:
        """finish_reason for req after its newest token, or None to go on."""
        s = req.sampling
        token = req.output_ids[-1]
        n_out = len(req.output_ids)
        if n_out >= s.min_new_tokens:
            if token in s.stop_token_ids:
                return finish_stop(token)
            if not s.ignore_eos and token in self.eos_token_ids:
                return finish_stop(token)
            if req.grammar is not None and req.grammar.is_terminated():
                return finish_stop(token)
            matched = self._stop_string(req)
            if matched is not None:
                return finish_stop(matched)
        if n_out >= s.max_new_tokens:
            return finish_length(n_out)
        if req.fill_len >= context_len:
            return finish_length(n_out)
        return None

    def _stop_string(self, req: Req) -> Optional[str]:
        s = req.sampling
        if s.stop:
            longest = max(len(x) for x in s.stop)
            tail = self.tokenizer.decode(req.output_ids[-(longest + STOP_WINDOW_EXTRA_TOKENS):])
            for stop in s.stop:
                if stop in tail:
                    return stop
        if s.stop_regex:
            tail = self.tokenizer.decode(req.output_ids[-REGEX_WINDOW_TOKENS:])
            for pattern in s.stop_regex:
                m = re.search(pattern, tail)
                if m:
                    return m.group(0)
        return None
