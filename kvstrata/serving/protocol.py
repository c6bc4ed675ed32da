"""Request parsing for the native `/generate` API: raw JSON in, a validated GenerateRequest out.

Every problem raises ApiError (errors.py) naming the field: the HTTP app answers it with
`{"error": {"message", "type", "param", "code"}}` and its status, Engine raises it as InvalidRequest.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from kvstrata.runtime.sampling_params import InvalidRequest, SamplingParams
from kvstrata.serving.errors import ApiError

# Seeds seed a 64-bit generator; copy j of an n > 1 request uses seed + j (n <= 128).
MAX_SEED = 2 ** 63 - 1 - 128

# Native fields that we cannot honour: rejecting them beats silently ignoring them.
_UNSUPPORTED_FIELDS = ("input_embeds", "image_data", "audio_data", "video_data", "lora_path", "lora_id",
                       "session_params", "custom_logit_processor", "token_ids_logprob")
# Flags SGLang's clients send as false; only true asks for something we do not have.
_UNSUPPORTED_FLAGS = ("return_hidden_states", "return_routed_experts")


def is_neutral(value: Any) -> bool:
    """A value that asks for nothing: null, "", false, or an empty / all-neutral list or object.

    SGLang's own clients always send some fields (`"lora_path": ""` in bench_multiturn.py, `null` in
    bench_serving.py); those must be accepted, and only a real value rejected.
    """
    if value is None or value == "" or value is False:
        return True
    if isinstance(value, list):
        return all(is_neutral(v) for v in value)
    if isinstance(value, dict):
        return all(is_neutral(v) for v in value.values())
    return False


@dataclass
class PromptSpec:
    """One prompt of a request with its own sampling settings; expanded to `sampling.n` sequences."""

    text: Optional[str]
    input_ids: Optional[list[int]]
    sampling: SamplingParams
    rid: str
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    max_new_tokens_explicit: bool = True   # False: max_new_tokens is a cap, clamped to the room left
    add_special_tokens: bool = True


@dataclass
class GenerateRequest:
    """A validated generation request (native or translated from the OpenAI API)."""

    prompts: list[PromptSpec]
    is_batch: bool = False
    stream: bool = False
    return_text_in_logprobs: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    cache_salt: Optional[str] = None     # requests with different salts never share cached KV
    priority: Optional[int] = None       # SGLang's request priority (higher first, unless flipped by a flag)


# ---------------------------------------------------------------------- JSON helpers
def parse_json_body(raw: bytes) -> dict:
    """Decode a request body that must be a JSON object."""
    if not raw:
        raise ApiError("the request body is empty; a JSON object is required")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    if b"\\u" in raw or b"\xed" in raw:     # a surrogate can only come from an escape or surrogatepass bytes
        check_no_surrogates(body)
    return body


def _reject_constant(name: str) -> Any:
    raise ApiError(f"the request body is not valid JSON: {name} is not a JSON number")


def get_cache_salt(body: dict) -> Optional[str]:
    """The optional `cache_salt` (vLLM's name): a non-empty string that isolates a tenant's cached KV."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ApiError("'cache_salt' must be a non-empty string", param="cache_salt")
    return salt


PRIORITY_RANGE = (-(2 ** 31), 2 ** 31 - 1)


def get_priority(body: dict) -> Optional[int]:
    """The optional `priority` (SGLang's field): an integer; what it means is the scheduler's settings'."""
    return get_int(body, "priority", None, *PRIORITY_RANGE)


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    """`body[name]` as a boolean (null means default)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"'{name}' must be a boolean, got {value!r}", param=name)
    return value


def get_int(body: dict, name: str, default: Optional[int] = None, lo: Optional[int] = None,
            hi: Optional[int] = None) -> Optional[int]:
    """`body[name]` as an integer in [lo, hi] (null means default; 3.0 is accepted as 3)."""
    value = body.get(name)
    if value is None:
        return default
    return check_int(value, name, lo, hi)


def check_int(value: Any, name: str, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """Validate one integer value and its range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (isinstance(value, float) and not math.isfinite(value)) or int(value) != value:
        raise ApiError(f"'{name}' must be an integer, got {value!r}", param=name)
    value = int(value)
    if lo is not None and value < lo:
        raise ApiError(f"'{name}' must be >= {lo}, got {value}", param=name)
    if hi is not None and value > hi:
        raise ApiError(f"'{name}' must be <= {hi}, got {value}", param=name)
    return value


def get_number(body: dict, name: str, lo: float, hi: float) -> Optional[float]:
    """`body[name]` as a number in [lo, hi], or None when absent/null."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(f"'{name}' must be a number, got {value!r}", param=name)
    if not lo <= value <= hi:
        raise ApiError(f"'{name}' must be between {lo} and {hi}, got {value}", param=name)
    return float(value)


def is_token_list(value: Any) -> bool:
    """A non-bool list of ints (a tokenized prompt)."""
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def sampling_from_dict(d: Any) -> SamplingParams:
    """SamplingParams.from_dict with InvalidRequest turned into a 400."""
    try:
        params = SamplingParams.from_dict(d)
    except InvalidRequest as e:
        raise ApiError(str(e), param="sampling_params") from e
    except (TypeError, ValueError, OverflowError) as e:  # values SamplingParams does not check
        raise ApiError(f"invalid sampling_params: {e}", param="sampling_params") from e
    seed = params.sampling_seed
    if seed is not None and not -MAX_SEED <= seed <= MAX_SEED:
        raise ApiError(f"the sampling seed must be between {-MAX_SEED} and {MAX_SEED}, got {seed}", param="seed")
    return params


def new_rid() -> str:
    """A fresh request id."""
    return uuid.uuid4().hex


# ---------------------------------------------------------------------- native /generate
def parse_generate(body: dict) -> GenerateRequest:
    """Validate a native `/generate` body (SGLang's GenerateReqInput)."""
    for name in _UNSUPPORTED_FIELDS + _UNSUPPORTED_FLAGS:
        if not is_neutral(body.get(name)):
            raise ApiError(f"'{name}' is not supported by this server (got {repr(body[name])[:60]}; only an "
                           f"empty value is accepted)", param=name)
    texts, ids, is_batch = _native_prompts(body)
    count = len(texts) if texts is not None else len(ids)
    sp_dicts = _per_prompt(body.get("sampling_params"), count, "sampling_params", dict)
    rids = _per_prompt(body.get("rid"), count, "rid", str)
    return_logprob = _per_prompt(body.get("return_logprob"), count, "return_logprob", bool)
    start_len = _per_prompt(body.get("logprob_start_len"), count, "logprob_start_len", int)
    top_num = _per_prompt(body.get("top_logprobs_num"), count, "top_logprobs_num", int)
    if isinstance(body.get("rid"), str) and is_batch:
        raise ApiError("'rid' must be a list of strings for a batch request", param="rid")
    prompts = []
    for i in range(count):
        sp = sp_dicts[i]
        rid = rids[i]
        if rid is not None and not rid:
            raise ApiError("'rid' must not be empty", param="rid")
        start = start_len[i] if start_len[i] is not None else -1
        check_int(start, "logprob_start_len", lo=-1)
        top = top_num[i] if top_num[i] is not None else 0
        check_int(top, "top_logprobs_num", lo=0)
        sampling = sampling_from_dict(sp)
        if start == -1 and return_logprob[i] and sampling.max_new_tokens == 0:
            start = 0      # scoring a prompt: SGLang's select() reads every input_token_logprobs entry
        prompts.append(PromptSpec(
            text=texts[i] if texts is not None else None,
            input_ids=ids[i] if ids is not None else None,
            sampling=sampling,
            rid=rid or new_rid(),
            return_logprob=bool(return_logprob[i]),
            logprob_start_len=int(start),
            top_logprobs_num=int(top),
            max_new_tokens_explicit=isinstance(sp, dict) and sp.get("max_new_tokens") is not None,
        ))
    _check_unique_rids(prompts)
    return GenerateRequest(prompts=prompts, is_batch=is_batch, stream=get_bool(body, "stream"),
                           return_text_in_logprobs=get_bool(body, "return_text_in_logprobs"),
                           cache_salt=get_cache_salt(body), priority=get_priority(body))


def _native_prompts(body: dict) -> tuple[Optional[list[str]], Optional[list[list[int]]], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None:
        raise ApiError("either 'text' or 'input_ids' must be given", param="text")
    if text is not None and ids is not None:
        raise ApiError("give either 'text' or 'input_ids', not both", param="text")
    if text is not None:
        if isinstance(text, str):
            texts, is_batch = [text], False
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            texts, is_batch = text, True
        else:
            raise ApiError("'text' must be a string or a list of strings", param="text")
        if not texts:
            raise ApiError("'text' must not be an empty list", param="text")
        if any(t == "" for t in texts):
            raise ApiError("the prompt text is empty", param="text")
        return texts, None, is_batch
    if is_token_list(ids):
        lists, is_batch = [ids], False
    elif isinstance(ids, list) and ids and all(is_token_list(x) for x in ids):
        lists, is_batch = ids, True
    else:
        raise ApiError("'input_ids' must be a list of integers or a list of such lists", param="input_ids")
    if any(len(x) == 0 for x in lists):
        raise ApiError("the prompt 'input_ids' is empty", param="input_ids")
    return None, lists, is_batch


def _per_prompt(value: Any, count: int, name: str, kind: type) -> list:
    """A scalar applies to every prompt; a list must have one entry per prompt."""
    if isinstance(value, list) and kind is not list:
        if len(value) != count:
            raise ApiError(f"'{name}' has {len(value)} entries but the batch has {count} prompts", param=name)
        items = value
    else:
        items = [value] * count
    for item in items:
        if item is None:
            continue
        ok = isinstance(item, kind) and not (kind is int and isinstance(item, bool))
        if not ok:
            raise ApiError(f"'{name}' must be of type {kind.__name__} (or a list of them), got {item!r}",
                           param=name)
    return items


def _check_unique_rids(prompts: list[PromptSpec]) -> None:
    rids = [p.rid for p in prompts]
    if len(set(rids)) != len(rids):
        raise ApiError("request ids ('rid') must be unique within a batch", param="rid")


# ---------------------------------------------------------------------- text validity
def check_no_surrogates(value: Any, path: str = "") -> None:
    """Reject a lone UTF-16 surrogate anywhere in a parsed body: it cannot be tokenized or sent back as UTF-8."""
    if isinstance(value, str):
        if _SURROGATE.search(value):
            name = path or "body"
            raise ApiError(f"'{name}' contains a lone UTF-16 surrogate, which is not valid Unicode text",
                           param=name.split("[")[0].split(".")[0])
    elif isinstance(value, dict):
        for key, item in value.items():
            check_no_surrogates(key, path or "body")
            check_no_surrogates(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_no_surrogates(item, f"{path}[{i}]")


_SURROGATE = re.compile("[\ud800-\udfff]")
