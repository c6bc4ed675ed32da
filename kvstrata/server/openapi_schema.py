"""The request bodies in /openapi.json: what the handlers accept, for clients, docs and the API fuzzer.

The models describe; they do not validate. Every handler still parses its raw body with its own parser
(protocol.py, openai_protocol.py), which is the one validation and gives the 400 messages; these models
only have to name the same fields with the same types. Unknown fields are allowed here because the
parsers decide about them (most SGLang extras are accepted, unsupported ones are rejected by name).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

Stop = Union[str, list[str], None]
NonEmptyStr = Annotated[str, Field(min_length=1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class SamplingParamsBody(_Body):
    """SGLang's sampling_params of /generate."""

    max_new_tokens: Optional[int] = Field(None, ge=0)
    min_new_tokens: Optional[int] = Field(None, ge=0)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = None
    min_p: Optional[float] = Field(None, ge=0, le=1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=2)
    stop: Stop = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = None
    no_stop_trim: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    n: Optional[int] = Field(None, ge=1, le=128)
    sampling_seed: Optional[int] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    json_schema: Union[str, dict[str, Any], None] = None


class GenerateBody(_Body):
    """POST /generate (SGLang's GenerateReqInput): one prompt or a batch; per-prompt fields may be lists."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"anyOf": [   # exactly one of the two
        {"required": ["text"], "not": {"required": ["input_ids"]}},
        {"required": ["input_ids"], "not": {"required": ["text"]}}]})

    text: Union[str, list[str], None] = Field(None, min_length=1)
    input_ids: Union[list[int], list[list[int]], None] = Field(None, min_length=1)
    sampling_params: Union[SamplingParamsBody, list[SamplingParamsBody], None] = None
    rid: Union[str, list[str], None] = None
    return_logprob: Union[bool, list[bool], None] = None
    logprob_start_len: Union[int, list[int], None] = None
    top_logprobs_num: Union[int, list[int], None] = None
    return_text_in_logprobs: Optional[bool] = None
    stream: Optional[bool] = None
    cache_salt: Optional[str] = None
    priority: Optional[int] = Field(None, ge=-(2 ** 31), le=2 ** 31 - 1)


class StreamOptions(_Body):
    include_usage: Optional[bool] = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict[str, Any]] = None


class _OpenAIBody(_Body):
    """Fields shared by completions and chat completions (OpenAI's, then SGLang's extras)."""

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=0)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: Optional[int] = Field(None, ge=1, le=128)
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    stop: Stop = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    response_format: Optional[ResponseFormat] = None
    user: Optional[str] = None
    min_tokens: Optional[int] = Field(None, ge=0)
    top_k: Optional[int] = None
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=2)
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = None
    no_stop_trim: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    json_schema: Union[str, dict[str, Any], None] = None
    rid: Optional[str] = None
    cache_salt: Optional[str] = None
    priority: Optional[int] = Field(None, ge=-(2 ** 31), le=2 ** 31 - 1)
    return_token_ids: Optional[bool] = None


class CompletionBody(_OpenAIBody):
    """POST /v1/completions."""

    prompt: Union[NonEmptyStr, list[NonEmptyStr], list[int], list[list[int]]] = Field(min_length=1)
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: Optional[bool] = None
    best_of: Optional[int] = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart]]      # null is accepted only from the assistant
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


class FunctionSpec(_Body):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatBody(_OpenAIBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Literal["none", "auto"]] = None
    continue_final_message: Optional[bool] = None


class AbortBody(_Body):
    """POST /abort_request (an admin action)."""

    rid: Optional[str] = None
    abort_all: Optional[bool] = None


class PrefetchBody(_Body):
    """POST /prefetch (an admin action): the token ids or text of a prompt about to arrive."""

    input_ids: Optional[list[int]] = None
    text: Optional[str] = None
    cache_namespace: Optional[str] = None


REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/generate": GenerateBody, "/v1/completions": CompletionBody, "/v1/chat/completions": ChatBody,
    "/abort_request": AbortBody, "/prefetch": PrefetchBody,
}


def install_openapi(app: FastAPI) -> None:
    """Serve /openapi.json with the request bodies above attached to their POST routes."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_openapi(app: FastAPI) -> dict:
    """FastAPI's schema of the routes plus our request bodies (nested models under components)."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in REQUEST_BODIES.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    return schema
