"""Request parsing for the OpenAI API: `/v1/chat/completions` and `/v1/completions` bodies → GenerateRequest.

OpenAI field names map onto SGLang's sampling params; SGLang's extras (top_k, min_p, regex, ebnf,
ignore_eos, continue_final_message, ...) are accepted too. Fields we cannot honour are rejected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from kvstrata.serving.protocol import (
    ApiError,
    GenerateRequest,
    PromptSpec,
    check_int,
    get_bool,
    get_cache_salt,
    get_int,
    get_number,
    get_priority,
    is_neutral,
    is_token_list,
    new_rid,
    sampling_from_dict,
)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOP_LOGPROBS = 20
# SGLang extras passed straight into sampling params (same names).
_EXTRA_SAMPLING = ("top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "no_stop_trim",
                   "skip_special_tokens", "spaces_between_special_tokens", "regex", "ebnf", "json_schema")


@dataclass
class OpenAIOptions:
    """What the response formatting needs to know about an OpenAI request."""

    kind: str                      # "chat" | "completion"
    model: str
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    prompt_texts: list[str] = field(default_factory=list)   # per prompt, for echo
    tool_parser: Any = None        # a ToolCallParser when the chat request has tools
    forced_tool_call: bool = False  # tool_choice required / named: the reply is one JSON call
    parallel_tool_calls: bool = True
    reasoning_parser: Optional[str] = None   # chat: split <think>...</think> into reasoning_content
    return_token_ids: bool = False  # vLLM's extension: prompt and output token ids in each choice


@dataclass
class ChatPrompt:
    """A chat request's messages and template settings, before the template is applied."""

    messages: list[dict]
    tools: Optional[list[dict]]
    continue_final_message: bool
    template_kwargs: Optional[dict] = None   # `chat_template_kwargs`: extra template variables
    tool_choice: str = "auto"            # "auto" | "required" | "function" (a named one: `tool_name`)
    tool_name: Optional[str] = None
    parallel_tool_calls: bool = True


def parse_chat(body: dict, default_model: str) -> tuple[ChatPrompt, GenerateRequest, OpenAIOptions]:
    """Validate a chat completions body; the GenerateRequest's prompt ids are filled in by the caller."""
    messages = _parse_messages(body.get("messages"))
    tools, tool_choice, tool_name = _parse_tools(body)
    cont = get_bool(body, "continue_final_message")
    if cont and messages[-1]["role"] != "assistant":
        raise ApiError("continue_final_message needs the last message to be from the assistant",
                       param="continue_final_message")
    max_tokens = get_int(body, "max_completion_tokens", lo=1)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", lo=1)
    logprobs = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise ApiError("top_logprobs requires logprobs to be true", param="top_logprobs")
    sampling, explicit = _sampling(body, max_tokens)
    opts = _options(body, "chat", default_model, sampling.n)
    opts.logprobs, opts.top_logprobs = logprobs, top
    prompt = PromptSpec(text=None, input_ids=None, sampling=sampling, rid=_rid(body),
                        return_logprob=logprobs, top_logprobs_num=top, max_new_tokens_explicit=explicit,
                        add_special_tokens=False)
    req = GenerateRequest(prompts=[prompt], stream=opts.stream, return_text_in_logprobs=True,
                          cache_salt=get_cache_salt(body), priority=get_priority(body))
    if tool_choice != "auto" and sampling.constraint is not None:
        raise ApiError("a forced tool call (tool_choice) cannot be combined with response_format, regex, ebnf "
                       "or json_schema", param="tool_choice")
    chat = ChatPrompt(messages, tools, cont, _template_kwargs(body), tool_choice, tool_name,
                      get_bool(body, "parallel_tool_calls", default=True))
    return chat, req, opts


def parse_completion(body: dict, default_model: str) -> tuple[GenerateRequest, OpenAIOptions]:
    """Validate a completions body."""
    prompts = _completion_prompts(body.get("prompt"))
    if body.get("suffix"):
        raise ApiError("'suffix' is not supported", param="suffix")
    max_tokens = get_int(body, "max_tokens", 16, lo=0)
    logprobs = get_int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    echo = get_bool(body, "echo")
    sampling, explicit = _sampling(body, max_tokens)
    best_of = get_int(body, "best_of", None, lo=1)
    if best_of is not None and best_of != sampling.n:
        raise ApiError("'best_of' different from 'n' is not supported", param="best_of")
    opts = _options(body, "completion", default_model, sampling.n)
    opts.logprobs, opts.top_logprobs, opts.echo = logprobs is not None, logprobs or 0, echo
    base_rid = _rid(body)
    specs = []
    for i, p in enumerate(prompts):
        specs.append(PromptSpec(
            text=p if isinstance(p, str) else None, input_ids=p if isinstance(p, list) else None,
            sampling=sampling, rid=base_rid if len(prompts) == 1 else f"{base_rid}-p{i}",
            return_logprob=logprobs is not None, top_logprobs_num=logprobs or 0,
            logprob_start_len=0 if echo and logprobs is not None else -1, max_new_tokens_explicit=explicit))
    req = GenerateRequest(prompts=specs, is_batch=len(prompts) > 1, stream=opts.stream,
                          cache_salt=get_cache_salt(body), priority=get_priority(body),
                          return_text_in_logprobs=True)
    return req, opts


# ---------------------------------------------------------------------- pieces
# OpenAI fields asking for something this server does not do: a 400 unless neutral (null, empty, false).
_UNSUPPORTED_OPENAI = ("audio", "prediction", "web_search_options")


def _options(body: dict, kind: str, default_model: str, n: int) -> OpenAIOptions:
    for name in _UNSUPPORTED_OPENAI:
        if not is_neutral(body.get(name)):
            raise ApiError(f"'{name}' is not supported by this server", param=name)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise ApiError("only text output is supported ('modalities': ['text'])", param="modalities")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError("'model' must be a string", param="model")
    stream = get_bool(body, "stream")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise ApiError("'stream_options' must be an object", param="stream_options")
        include_usage = get_bool(stream_options, "include_usage")
    for name in ("user",):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise ApiError(f"'{name}' must be a string", param=name)
    return OpenAIOptions(kind=kind, model=model or default_model, n=n, stream=stream,
                         include_usage=include_usage, return_token_ids=get_bool(body, "return_token_ids"))


def _sampling(body: dict, max_tokens: Optional[int]) -> tuple[Any, bool]:
    """SamplingParams from OpenAI fields (+ SGLang extras); also whether max_tokens was explicit."""
    get_number(body, "temperature", 0.0, 2.0)
    get_number(body, "top_p", 0.0, 1.0)
    get_number(body, "presence_penalty", -2.0, 2.0)
    get_number(body, "frequency_penalty", -2.0, 2.0)
    n = get_int(body, "n", 1, lo=1, hi=128)
    get_int(body, "min_tokens", lo=0)
    seed = body.get("seed")
    if seed is not None:
        check_int(seed, "seed")
    d: dict[str, Any] = {
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "presence_penalty": body.get("presence_penalty"), "frequency_penalty": body.get("frequency_penalty"),
        "n": n, "stop": body.get("stop"), "sampling_seed": seed, "min_new_tokens": body.get("min_tokens"),
        "logit_bias": body.get("logit_bias") or None,
    }
    for name in _EXTRA_SAMPLING:
        if body.get(name) is not None:
            d[name] = body[name]
    constraint = _response_format(body.get("response_format"))
    if constraint is not None:
        if any(d.get(k) is not None for k in ("regex", "ebnf", "json_schema")):
            raise ApiError("response_format cannot be combined with regex, ebnf or json_schema",
                           param="response_format")
        d["json_schema"] = constraint
    explicit = max_tokens is not None
    # Without max_tokens a chat completion may use the whole context (fitted later by the frontend).
    d["max_new_tokens"] = max_tokens if explicit else 1 << 30
    if d.get("min_new_tokens") is not None and explicit:
        check_int(d["min_new_tokens"], "min_tokens", lo=0, hi=max_tokens)
    return sampling_from_dict(d), explicit


def _response_format(rf: Any) -> Optional[str]:
    """The JSON schema (as a string) that response_format asks for, or None."""
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ApiError("'response_format' must be an object with a 'type'", param="response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise ApiError("response_format 'json_schema' must be an object with a 'schema'",
                           param="response_format")
        schema = spec.get("schema", spec.get("schema_"))
        if not isinstance(schema, (dict, bool)):
            raise ApiError("response_format.json_schema.schema must be a JSON schema object",
                           param="response_format")
        return json.dumps(schema)
    raise ApiError(f"response_format type '{kind}' is not supported (use text, json_object or json_schema)",
                   param="response_format")


def _parse_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {role!r}",
                           param="messages")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = _flatten_content(m.get("content"), i, role, bool(m.get("tool_calls")))
        if "tool_calls" in msg and not isinstance(msg["tool_calls"], list):
            raise ApiError(f"messages[{i}].tool_calls must be a list", param="messages")
        out.append(msg)
    return out


def _flatten_content(content: Any, i: int, role: str, has_tool_calls: bool) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant":
            return ""
        raise ApiError(f"messages[{i}].content is required for role '{role}'", param="messages")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(f"messages[{i}].content: only text parts are supported, got {kind!r}",
                               param="messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ApiError(f"messages[{i}].content must be a string or a list of text parts", param="messages")


def _parse_tools(body: dict) -> tuple[Optional[list[dict]], str, Optional[str]]:
    """(tools for the template, tool_choice as "auto" | "required" | "function", the named function)."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise ApiError(f"'{legacy}' is not supported; use 'tools' and 'tool_choice'", param=legacy)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ApiError("'tools' must be a list of objects", param="tools")
        for t in tools:
            fn = t.get("function")
            if t.get("type", "function") != "function" or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str):
                raise ApiError("each tool must be {'type': 'function', 'function': {'name': ...}}", param="tools")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise ApiError(f"tool {fn['name']!r}: 'parameters' must be a JSON schema object", param="tools")
    choice, name = _tool_choice(body.get("tool_choice"))
    if choice == "none":
        return None, "auto", None
    if choice != "auto" and not tools:
        raise ApiError(f"tool_choice {body.get('tool_choice')!r} needs 'tools'", param="tool_choice")
    if name is not None and name not in {t["function"]["name"] for t in tools or []}:
        raise ApiError(f"tool_choice names the function {name!r}, which is not in 'tools'", param="tool_choice")
    return tools or None, choice, name


def _template_kwargs(body: dict) -> Optional[dict]:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return None
    reserved = {"messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize"}
    if not isinstance(kwargs, dict) or reserved & set(kwargs):
        raise ApiError(f"'chat_template_kwargs' must be an object of template variables (not {sorted(reserved)})",
                       param="chat_template_kwargs")
    return kwargs


def _tool_choice(choice: Any) -> tuple[str, Optional[str]]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(fn, dict) \
            and isinstance(fn.get("name"), str):
        return "function", fn["name"]
    raise ApiError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                   "{'name': ...}}", param="tool_choice")


def _completion_prompts(prompt: Any) -> list:
    if prompt is None:
        raise ApiError("'prompt' is required", param="prompt")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif is_token_list(prompt) and prompt:
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                 or all(is_token_list(p) for p in prompt)):
        prompts = prompt
    else:
        raise ApiError("'prompt' must be a string, a list of strings, a list of token ids or a list of such "
                       "lists (non-empty)", param="prompt")
    if any(len(p) == 0 for p in prompts):
        raise ApiError("the prompt is empty", param="prompt")
    return prompts


def _rid(body: dict) -> str:
    rid = body.get("rid")
    if rid is None:
        return new_rid()
    if not isinstance(rid, str) or not rid:
        raise ApiError("'rid' must be a non-empty string", param="rid")
    return rid
