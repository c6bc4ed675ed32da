"""SeqState: one output sequence as its caller sees it — scheduler deltas in, text and logprobs out.

The transport's receive side only appends raw `ReqOutput`s (`push`); the request's own coroutine (or
thread, in Engine) applies them (`drain`), so detokenization runs at the pace of the caller that reads it.

Stop strings: the scheduler ends a request when a stop string appears but only knows tokens, so the
text is trimmed here. While a request streams, any suffix that could be the start of a stop string is
held back, so a stop string never shows up in a streamed delta either.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from kvstrata.runtime.messages import ReqOutput
from kvstrata.runtime.sampling_params import SamplingParams


def stop_safe_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest prefix of `text` that contains no stop string and cannot grow into one."""
    end = len(text)
    for stop in stops:
        pos = text.find(stop)
        if pos >= 0:
            end = min(end, pos)
            continue
        # Hold back the longest suffix of text that is a proper prefix of this stop string.
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                end = min(end, len(text) - k)
                break
    return end


def trim_at_stop(text: str, stops: list[str]) -> str:
    """`text` cut right before the first occurrence of any stop string."""
    end = len(text)
    for stop in stops:
        pos = text.find(stop)
        if pos >= 0:
            end = min(end, pos)
    return text[:end]


class SeqState:
    """Progress of one output sequence (one of the n copies of one prompt)."""

    def __init__(self, rid: str, index: int, prompt_index: int, input_ids: list[int],
                 sampling: SamplingParams, detokenizer: Any, wake: asyncio.Event, group_rid: str = "",
                 return_logprob: bool = False, top_logprobs_num: int = 0):
        self.rid = rid
        self.group_rid = group_rid or rid   # the user's rid (one per prompt)
        self.index = index                  # position in the response (i * n + j)
        self.prompt_index = prompt_index
        self.input_ids = input_ids
        self.sampling = sampling
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        self.detokenizer = detokenizer
        self.wake = wake                    # shared by all sequences of one HTTP request
        self.pending: list[ReqOutput] = []
        self.created_at = time.monotonic()
        self.finished_at: Optional[float] = None

        self.output_ids: list[int] = []
        self.text = ""                      # everything detokenized so far (before stop trimming)
        self.finished = False
        self.finish_reason: Optional[dict] = None
        self.prompt_tokens = len(input_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[Any] = []
        self.input_token_logprobs: Optional[list] = None
        self.input_top_logprobs: Optional[list] = None
        self.error: Optional[str] = None
        self.error_status = 400
        self.sent_text_len = 0              # for consumers that send deltas
        self.sent_logprobs = 0
        self.sent_token_ids = 0             # output ids already streamed (return_token_ids)
        self.sent_input_logprobs = False
        self._failed_unseen = False         # fail() happened and no drain() has reported it yet
        self.stream = False                 # the client reads a stream (set by expand_sequences)
        # Arrival times of token deltas (receive loop), for the latency histograms.
        self.first_token_at: Optional[float] = None
        self.last_token_at: Optional[float] = None
        self.inter_token_s: list[float] = []   # per delta after the first: its gap / its token count

    # ------------------------------------------------------------------ receive side
    def push(self, out: ReqOutput) -> None:
        """Queue one scheduler delta and wake the consumer (called by the receive loop)."""
        if out.new_token_ids:
            self._record_arrival(len(out.new_token_ids))
        self.pending.append(out)
        self.wake.set()

    def _record_arrival(self, num_tokens: int) -> None:
        now = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        elif self.last_token_at is not None:
            self.inter_token_s.append((now - self.last_token_at) / num_tokens)
        self.last_token_at = now

    def fail(self, message: str, status: int) -> None:
        """End the sequence with an error (e.g. the scheduler process died)."""
        if self.finished:
            return
        self.error, self.error_status = message, status
        self._finish({"type": "abort", "message": message})
        self._failed_unseen = True
        self.wake.set()

    def end_now(self, message: str, status: int) -> None:
        """Queue the end of this sequence after what is pending: a stream gets finish_reason 'abort',
        a non-streaming request an error with `status` (used by the graceful shutdown)."""
        if self.finished:
            return
        last = self.pending[-1] if self.pending else None
        self.push(ReqOutput(
            rid=self.rid, new_token_ids=[], finished=True, finish_reason={"type": "abort", "message": message},
            prompt_tokens=last.prompt_tokens if last else self.prompt_tokens,
            completion_tokens=last.completion_tokens if last else self.completion_tokens,
            cached_tokens=last.cached_tokens if last else self.cached_tokens,
            error=None if self.stream else message, error_status=status))

    def pending_error(self) -> Optional[tuple[str, int]]:
        """(message, status) of an error not yet drained, if any."""
        if self.error is not None:
            return self.error, self.error_status
        for out in self.pending:
            if out.error is not None:
                return out.error, out.error_status
        return None

    # ------------------------------------------------------------------ consumer side
    @property
    def done(self) -> bool:
        """Finished (normally, aborted or failed) and fully drained."""
        return self.finished and not self.pending

    def drain(self) -> bool:
        """Apply queued deltas; True if anything changed (a failure counts once)."""
        if not self.pending:
            failed, self._failed_unseen = self._failed_unseen, False
            return failed
        self._failed_unseen = False
        pending, self.pending = self.pending, []
        for out in pending:
            self._apply(out)
        return True

    def _apply(self, out: ReqOutput) -> None:
        if self.finished:
            return
        if out.error is not None:
            self.error, self.error_status = out.error, out.error_status
        new_ids = list(out.new_token_ids)
        self.output_ids.extend(new_ids)
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.output_token_logprobs.extend(out.output_token_logprobs)
        self.output_top_logprobs.extend(out.output_top_logprobs)
        if out.input_token_logprobs is not None:
            self.input_token_logprobs = list(out.input_token_logprobs)
            self.input_top_logprobs = list(out.input_top_logprobs or [])
        to_decode = new_ids
        if out.finished and self._trims_stop_token(out.finish_reason) and to_decode:
            to_decode = to_decode[:-1]       # a matched stop token id is not part of the text
        if to_decode:
            self.text += self.detokenizer.add(to_decode)
        if out.finished:
            self.text += self.detokenizer.flush()    # a trailing incomplete character, if any
            self._finish(out.finish_reason)

    def _trims_stop_token(self, reason: Optional[dict]) -> bool:
        return (not self.sampling.no_stop_trim and isinstance(reason, dict) and reason.get("type") == "stop"
                and isinstance(reason.get("matched"), int) and not isinstance(reason.get("matched"), bool))

    def _finish(self, reason: Optional[dict]) -> None:
        self.finished = True
        self.finish_reason = reason
        self.finished_at = time.monotonic()

    def visible_text(self) -> str:
        """Text the client may see now: stop strings trimmed, possible stop-string starts held back."""
        stops = self.sampling.stop
        if self.sampling.no_stop_trim:
            return self.text
        if self.finished:     # stop strings, and the text a stop_regex matched (as SGLang trims it)
            return trim_at_stop(self.text, stops + self._matched_regex_text())
        if not stops:
            return self.text
        return self.text[:stop_safe_prefix_len(self.text, stops)]

    def _matched_regex_text(self) -> list[str]:
        """The text a stop_regex matched: trimmed like a stop string (SGLang's trim_matched_stop)."""
        matched = (self.finish_reason or {}).get("matched")
        return [matched] if self.sampling.stop_regex and isinstance(matched, str) and matched else []

    def take_text_delta(self) -> str:
        """The visible text not handed out by a previous call (for delta-streaming APIs)."""
        text = self.visible_text()
        delta = text[self.sent_text_len:]
        self.sent_text_len = max(self.sent_text_len, len(text))
        return delta

    def take_logprob_delta(self) -> tuple[list, list]:
        """Output (token logprobs, top logprobs) not handed out by a previous call."""
        start = self.sent_logprobs
        self.sent_logprobs = len(self.output_token_logprobs)
        return self.output_token_logprobs[start:], self.output_top_logprobs[start:]

    @property
    def e2e_latency(self) -> float:
        """Seconds from arrival to finish (or to now while running)."""
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return end - self.created_at

