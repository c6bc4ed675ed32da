"""The request frontend shared by the HTTP server and `kvstrata.Engine`: every request rule lives here once.

Both entrypoints parse into a `GenerateRequest` (protocol.parse_generate, or the OpenAI parsers) and then:

    text_prompts / encode_prompts   text → token ids (text too long to fit the context is refused untokenized)
    prepare_prompt                  the one validation against the model (vocabulary, context, KV pool), and
                                    a defaulted max_new_tokens fitted to the room the context leaves
    expand_sequences                n-expansion: one SeqState per output sequence, in i*n+j order
    scheduler_request               the TokenizedGenerateReq one sequence sends to the scheduler
    native_output / native_response SGLang's result shape: text, output_ids, meta_info and logprob triples

Stop trimming and incremental detokenization are SeqState's (seq_state.py), the running sequences the
SequenceRegistry's (registry.py). A transport — the SchedulerClient's ZMQ sockets (server/) or the Engine's
queues — only carries TokenizedGenerateReq in and ReqOutput out. The scheduler trusts what arrives that
way and checks none of these rules again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Optional

from kvstrata.model.tokenizer import IncrementalDetokenizer
from kvstrata.runtime.messages import SchedulerReady, TokenizedGenerateReq
from kvstrata.runtime.sampling_params import InvalidRequest, SamplingParams
from kvstrata.serving.errors import ApiError
from kvstrata.serving.protocol import GenerateRequest, PromptSpec
from kvstrata.serving.seq_state import SeqState

MIN_LOGPROB = -9999.0          # stands for -inf (a token masked out by top-k/top-p): JSON has no infinity


@dataclass(frozen=True)
class RequestLimits:
    """What the model and its KV pool allow a request, as the scheduler reported them."""

    context_length: int
    max_total_tokens: int
    vocab_size: int
    max_prompt_chars: int        # more characters than this cannot fit the context whatever they tokenize to

    @staticmethod
    def of(info: SchedulerReady, tokenizer: Any) -> RequestLimits:
        """Limits of the scheduler that sent `info`, for prompts tokenized by `tokenizer`."""
        return RequestLimits(info.context_length, info.max_total_tokens, info.vocab_size,
                             info.context_length * longest_token_chars(tokenizer))


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token stands for (its vocabulary spelling is never shorter)."""
    try:
        return max(1, max(len(token) for token in tokenizer.get_vocab()))
    except (AttributeError, TypeError, ValueError):
        return 1 << 10      # no vocabulary to look at: a loose bound that still stops absurd bodies


# ---------------------------------------------------------------------- tokenizing
def check_prompt_chars(chars: int, limits: RequestLimits, param: str) -> None:
    """400 when `chars` characters are already more tokens than the context holds (no tokenizing needed)."""
    if chars > limits.max_prompt_chars:
        raise ApiError(f"the prompt ({chars} characters) is longer than the model's context length "
                       f"({limits.context_length} tokens) can hold", param=param)


def text_prompts(req: GenerateRequest, limits: RequestLimits) -> list[PromptSpec]:
    """The prompts of `req` still to tokenize; refuses an overlong one before any tokenizing."""
    texts = [p for p in req.prompts if p.input_ids is None]
    for p in texts:
        check_prompt_chars(len(p.text or ""), limits, "text")
    return texts


def encode_prompts(prompts: list[PromptSpec], tokenizer: Any) -> None:
    """Fill in `input_ids` of text prompts (with the special tokens each asks for)."""
    for p in prompts:
        p.input_ids = list(tokenizer.encode(p.text or "", add_special_tokens=p.add_special_tokens))


# ---------------------------------------------------------------------- validation
def prepare_prompt(p: PromptSpec, limits: RequestLimits) -> tuple[list[int], SamplingParams]:
    """Token ids of one tokenized prompt and its sampling params fitted to the context; raises ApiError.

    The length rule is SGLang's: a prompt must leave room for one token; an explicit max_new_tokens that
    does not fit is refused, a defaulted one is cut to the room left (context and KV pool).
    """
    ids = list(p.input_ids or [])
    n = len(ids)
    if n == 0:
        raise ApiError("the prompt is empty after tokenization")
    vocab = limits.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(f"input_ids contain token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                       param="input_ids")
    if p.return_logprob and p.logprob_start_len >= n:
        raise ApiError(f"logprob_start_len ({p.logprob_start_len}) must be smaller than the prompt "
                       f"length ({n} tokens)", param="logprob_start_len")
    if p.top_logprobs_num > vocab:
        raise ApiError(f"top_logprobs_num ({p.top_logprobs_num}) exceeds the vocabulary size ({vocab})",
                       param="top_logprobs_num")
    return ids, _fit_sampling(p, n, limits)


def _fit_sampling(p: PromptSpec, n: int, limits: RequestLimits) -> SamplingParams:
    s = dataclasses.replace(p.sampling)
    try:
        s.verify(limits.vocab_size)       # token ids in stop_token_ids / logit_bias; top_k >= vocab is -1
    except InvalidRequest as e:
        raise ApiError(str(e), param="sampling_params") from e
    limit = limits.context_length
    if n > limit or (n == limit and s.max_new_tokens > 0):
        raise ApiError(f"the prompt ({n} tokens) is longer than the model's context length ({limit} tokens)")
    if not p.max_new_tokens_explicit:
        room = max(0, min(limit, limits.max_total_tokens) - n)
        if s.max_new_tokens > room:
            s = dataclasses.replace(s, max_new_tokens=room, min_new_tokens=min(s.min_new_tokens, room))
    elif n + s.max_new_tokens > limit:
        raise ApiError(f"the prompt ({n} tokens) plus the requested completion ({s.max_new_tokens} "
                       f"tokens) exceeds the model's context length ({limit} tokens)")
    if n + s.max_new_tokens > limits.max_total_tokens:      # a prompt the pool cannot hold, even fitted
        raise ApiError(f"the request needs up to {n + s.max_new_tokens} tokens of KV cache but the pool "
                       f"holds {limits.max_total_tokens}")
    return s


# ---------------------------------------------------------------------- n-expansion
def expand_sequences(req: GenerateRequest, limits: RequestLimits, tokenizer: Any, wake: Any) -> list[SeqState]:
    """Validate every prompt of `req`, then one SeqState per output sequence, in response order (i*n+j).

    `wake` is whatever the transport's consumer waits on (`.set()` is called on news); copy j of a seeded
    prompt is seeded with seed + j, and gets the rid `<rid>-<j>` when n > 1.
    """
    prepared = [prepare_prompt(p, limits) for p in req.prompts]
    states: list[SeqState] = []
    for i, (p, (ids, sampling)) in enumerate(zip(req.prompts, prepared)):
        n = sampling.n
        rids = [p.rid] if n == 1 else [f"{p.rid}-{j}" for j in range(n)]
        for j, rid in enumerate(rids):
            seed = None if sampling.sampling_seed is None else sampling.sampling_seed + j
            copy = dataclasses.replace(sampling, n=1, sampling_seed=seed)
            detok = IncrementalDetokenizer(tokenizer, prompt_ids=ids, skip_special_tokens=copy.skip_special_tokens,
                                           spaces_between_special_tokens=copy.spaces_between_special_tokens)
            states.append(SeqState(rid, len(states), i, ids, copy, detok, wake, group_rid=p.rid,
                                   return_logprob=p.return_logprob, top_logprobs_num=p.top_logprobs_num))
            states[-1].stream = req.stream
    return states


def scheduler_request(req: GenerateRequest, state: SeqState) -> TokenizedGenerateReq:
    """The scheduler's message for one output sequence of `req`."""
    p = req.prompts[state.prompt_index]
    return TokenizedGenerateReq(
        rid=state.rid, input_ids=state.input_ids, sampling_params=state.sampling,
        return_logprob=p.return_logprob, logprob_start_len=p.logprob_start_len if p.return_logprob else -1,
        top_logprobs_num=p.top_logprobs_num, stream=req.stream, cache_namespace=req.cache_salt,
        priority=req.priority, bootstrap=req.extra.get("bootstrap"))


async def sequence_updates(states: list[SeqState],
                           wait: Callable[[Any], Awaitable[None]]) -> AsyncIterator[list[SeqState]]:
    """Yield the sequences that changed, until all are done; `wait(wake)` blocks until news arrive."""
    wake = states[0].wake
    while True:
        wake.clear()
        changed = [s for s in states if s.drain()]
        if changed:
            yield changed
        if all(s.done for s in states):
            return
        if not changed:
            await wait(wake)


def raise_first_error(states: list[SeqState]) -> None:
    """Raise ApiError for the first sequence that failed (pending or applied)."""
    for s in states:
        err = s.pending_error()
        if err is not None:
            raise ApiError(err[0], err[1])


# ---------------------------------------------------------------------- results
class TokenTexts:
    """The text of single tokens, as shown next to logprobs (cached: the same ids come back often)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        """The text of `token_id`, special tokens spelled out."""
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text


TokenText = Callable[[int], str]


def native_response(req: GenerateRequest, states: list[SeqState], token_text: TokenText) -> Any:
    """The whole result: one dict, or a list in request order (i*n+j) for a batch or n > 1."""
    outs = [native_output(req, s, token_text) for s in states]
    if not req.is_batch and len(outs) == 1:
        return outs[0]
    return outs


def native_output(req: GenerateRequest, s: SeqState, token_text: TokenText, delta_logprobs: bool = False) -> dict:
    """{text, output_ids, meta_info} of one sequence; `delta_logprobs`: only output logprobs not yet sent."""
    meta: dict[str, Any] = {
        "id": s.rid,
        "finish_reason": s.finish_reason if s.finished else None,
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "cached_tokens": s.cached_tokens,
        "e2e_latency": round(s.e2e_latency, 6),
    }
    if s.return_logprob:
        text = token_text if req.return_text_in_logprobs else None
        if delta_logprobs:
            out_lp, out_top = s.take_logprob_delta()
        else:
            out_lp, out_top = s.output_token_logprobs, s.output_top_logprobs
        meta["input_token_logprobs"] = format_logprobs(s.input_token_logprobs or [], text)
        meta["output_token_logprobs"] = format_logprobs(out_lp, text)
        meta["input_top_logprobs"] = [format_top(t, text) for t in s.input_top_logprobs or []]
        meta["output_top_logprobs"] = [format_top(t, text) for t in out_top]
    return {"text": s.visible_text(), "output_ids": list(s.output_ids), "meta_info": meta}


def format_logprobs(entries: list, token_text: Optional[TokenText]) -> list[list]:
    """[(logprob, token_id), ...] → [[logprob, token_id, text or None], ...] (text only with `token_text`)."""
    return [[finite_logprob(lp), tid, token_text(tid) if token_text else None] for lp, tid in entries]


def format_top(entries: Optional[list], token_text: Optional[TokenText]) -> Optional[list]:
    """One position's top logprobs in the same triple format (None stays None)."""
    if entries is None:
        return None
    return format_logprobs(entries, token_text)


def finite_logprob(lp: Optional[float]) -> Optional[float]:
    """-inf (a token masked out by top-k/top-p) as -9999.0: JSON has no infinity."""
    if lp is None or math.isfinite(lp):
        return lp
    return MIN_LOGPROB
