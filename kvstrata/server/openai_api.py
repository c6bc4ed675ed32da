"""OpenAI-compatible endpoints: chat completions, completions and models."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Optional

from starlette.requests import Request
from starlette.responses import Response

from kvstrata.server.disagg_fields import attach_bootstrap
from kvstrata.server.native_api import run_request
from kvstrata.server.openai_protocol import ChatPrompt, OpenAIOptions, parse_chat, parse_completion
from kvstrata.server.reasoning import ReasoningStreamer, split_reasoning
from kvstrata.server.scheduler_client import SchedulerClient
from kvstrata.server.tool_calls import ToolCall, forced_call_schema, new_streamer, select_parser
from kvstrata.serving.errors import ApiError
from kvstrata.serving.frontend import finite_logprob
from kvstrata.serving.protocol import GenerateRequest, get_bool, parse_json_body
from kvstrata.serving.seq_state import SeqState
from kvstrata.web.sse import SSE_DONE, sse_event


async def handle_chat(request: Request, client: SchedulerClient) -> Response:
    """POST /v1/chat/completions."""
    from kvstrata.model.tokenizer import apply_chat_template

    body = parse_json_body(await request.body())
    chat, req, opts = parse_chat(body, client.args.served_model_name or "")
    attach_bootstrap(body, req)
    cont = chat.continue_final_message
    client.check_prompt_chars(sum(len(m["content"]) for m in chat.messages), "messages")
    try:
        prompt = await client.run_blocking(apply_chat_template, client.tokenizer, chat.messages,
                                       add_generation_prompt=not cont, continue_final_message=cont,
                                       tools=chat.tools, template_kwargs=chat.template_kwargs)
    except Exception as e:  # a template that rejects these messages is the client's problem
        raise ApiError(f"cannot apply the chat template to these messages: {e}", param="messages") from e
    req.prompts[0].input_ids = prompt if isinstance(prompt, list) else \
        await client.run_blocking(client.encode, prompt, add_special_tokens=False)
    _set_up_tool_calls(client, chat, req, opts)
    if get_bool(body, "separate_reasoning", default=True):     # SGLang's per-request switch
        opts.reasoning_parser = client.args.reasoning_parser
    return await _run(request, client, req, opts)


def _set_up_tool_calls(client: SchedulerClient, chat: ChatPrompt, req: GenerateRequest, opts: OpenAIOptions) -> None:
    """Pick the tool-call parser; a forced call (required / named) constrains the output to its schema."""
    if not chat.tools:
        return
    opts.tool_parser = select_parser(client.args.tool_call_parser, getattr(client.tokenizer, "chat_template", None),
                                     chat.tools)
    opts.parallel_tool_calls = chat.parallel_tool_calls
    if chat.tool_choice == "auto":
        return
    opts.forced_tool_call = True
    schema = forced_call_schema(chat.tools, chat.tool_name, opts.tool_parser)
    prompt = req.prompts[0]
    prompt.sampling = dataclasses.replace(prompt.sampling, json_schema=json.dumps(schema))


async def handle_completion(request: Request, client: SchedulerClient) -> Response:
    """POST /v1/completions."""
    body = parse_json_body(await request.body())
    req, opts = parse_completion(body, client.args.served_model_name or "")
    attach_bootstrap(body, req)
    return await _run(request, client, req, opts)


async def _run(request: Request, client: SchedulerClient, req: GenerateRequest, opts: OpenAIOptions) -> Response:
    prefix = "chatcmpl-" if opts.kind == "chat" else "cmpl-"
    resp_id, created = prefix + uuid.uuid4().hex, int(time.time())

    def respond(client: SchedulerClient, req: GenerateRequest, states: list[SeqState]) -> dict:
        return openai_response(client, req, states, opts, resp_id, created)

    def stream(client: SchedulerClient, req: GenerateRequest, states: list[SeqState]) -> AsyncIterator[str]:
        return openai_stream(client, req, states, opts, resp_id, created)

    if opts.echo:
        opts.prompt_texts = [p.text if p.text is not None else client.decode(p.input_ids or []) for p in req.prompts]
    return await run_request(request, client, req, respond, stream)


# ---------------------------------------------------------------------- models
def model_card(client: SchedulerClient, created: int) -> dict:
    """The /v1/models entry of the served model."""
    return {"id": client.args.served_model_name, "object": "model", "created": created, "owned_by": "kvstrata",
            "root": client.args.model_path, "max_model_len": client.context_length}


def list_models(client: SchedulerClient, created: int) -> dict:
    """GET /v1/models."""
    return {"object": "list", "data": [model_card(client, created)]}


def retrieve_model(client: SchedulerClient, created: int, model_id: str) -> dict:
    """GET /v1/models/{id}; 404 for any other id."""
    if model_id != client.args.served_model_name:
        raise ApiError(f"the model '{model_id}' does not exist", 404, param="model")
    return model_card(client, created)


# ---------------------------------------------------------------------- responses
def openai_response(client: SchedulerClient, req: GenerateRequest, states: list[SeqState], opts: OpenAIOptions,
                    resp_id: str, created: int) -> dict:
    """A complete (non-streaming) chat.completion or text_completion object."""
    choices = []
    for s in states:
        text = s.visible_text()
        choice: dict[str, Any] = {"index": s.index, "logprobs": None, "finish_reason": finish_reason(s),
                                  "matched_stop": matched_stop(s)}
        if opts.kind == "chat":
            reasoning = None
            if opts.reasoning_parser:
                reasoning, text = split_reasoning(opts.reasoning_parser, text)
            content, calls = _split_tool_calls(opts, text)
            choice["message"] = {"role": "assistant", "content": content,
                                 "tool_calls": [c.to_openai() for c in calls] or None}
            if opts.reasoning_parser:
                choice["message"]["reasoning_content"] = reasoning or None
            if calls:
                choice["finish_reason"] = "tool_calls"
            if opts.logprobs:
                choice["logprobs"] = chat_logprobs(client, s.output_token_logprobs, s.output_top_logprobs)
        else:
            prefix = opts.prompt_texts[s.prompt_index] if opts.echo else ""
            choice["text"] = prefix + text
            if opts.logprobs:
                entries, tops = list(s.output_token_logprobs), list(s.output_top_logprobs)
                if opts.echo:
                    entries = list(s.input_token_logprobs or []) + entries
                    tops = list(s.input_top_logprobs or []) + tops
                choice["logprobs"] = completion_logprobs(client, entries, tops, 0)
        if opts.return_token_ids:
            choice["prompt_token_ids"], choice["token_ids"] = list(s.input_ids), list(s.output_ids)
        choices.append(choice)
    return {"id": resp_id, "object": "chat.completion" if opts.kind == "chat" else "text_completion",
            "created": created, "model": opts.model, "choices": choices, "usage": usage(states)}


async def openai_stream(client: SchedulerClient, req: GenerateRequest, states: list[SeqState], opts: OpenAIOptions,
                        resp_id: str, created: int) -> AsyncIterator[str]:
    """chat.completion.chunk / text_completion events; one finish_reason per choice; optional usage."""
    obj = "chat.completion.chunk" if opts.kind == "chat" else "text_completion"

    def chunk(choices: list[dict], usage_: Optional[dict] = None) -> str:
        return sse_event({"id": resp_id, "object": obj, "created": created, "model": opts.model,
                          "choices": choices, "usage": usage_})

    text_offsets = {s.index: 0 for s in states}
    streamers = {s.index: new_streamer(opts.tool_parser, opts.forced_tool_call)
                 for s in states} if opts.tool_parser else {}
    call_counts = {s.index: 0 for s in states}
    reasoners = {s.index: ReasoningStreamer(opts.reasoning_parser)
                 for s in states} if opts.reasoning_parser else {}
    for s in states:
        if opts.kind == "chat":
            yield chunk([{"index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        elif opts.echo:
            echo = opts.prompt_texts[s.prompt_index]
            text_offsets[s.index] = len(echo)
            yield chunk([{"index": s.index, "text": echo, "logprobs": None, "finish_reason": None}])
    finish_sent: set[int] = set()
    async with contextlib.aclosing(client.updates(states)) as updates:
        async for changed in updates:
            for s in changed:
                if s.error is not None:
                    yield sse_event(ApiError(s.error, s.error_status).to_dict())
                    yield SSE_DONE
                    return
                if s.index in finish_sent:
                    continue
                choice, changed_ = _delta_choice(client, s, opts, text_offsets)
                if s.index in reasoners:
                    _stream_reasoning(choice, reasoners[s.index], s.finished)
                if s.index in streamers:
                    _stream_tool_calls(choice, streamers[s.index], s.finished, call_counts, s.index,
                                       opts.parallel_tool_calls)
                if reasoners or streamers:     # they may hold text back, or complete a call
                    changed_ = bool(choice["delta"] or choice.get("logprobs") or choice.get("token_ids"))
                if s.finished:
                    finish_sent.add(s.index)
                    choice["finish_reason"] = "tool_calls" if call_counts[s.index] else finish_reason(s)
                    choice["matched_stop"] = matched_stop(s)
                elif not changed_:
                    continue
                yield chunk([choice])
    if opts.include_usage:
        yield chunk([], usage(states))
    yield SSE_DONE


def _delta_choice(client: SchedulerClient, s: SeqState, opts: OpenAIOptions,
                  text_offsets: dict[int, int]) -> tuple[dict, bool]:
    """The choice of one chunk with what `s` produced since the previous chunk; and whether it is new."""
    text = s.take_text_delta()
    entries, tops = s.take_logprob_delta() if opts.logprobs else ([], [])
    if opts.logprobs and opts.echo and not s.sent_input_logprobs and s.input_token_logprobs is not None:
        s.sent_input_logprobs = True      # prompt logprobs go with the first generated ones
        entries = list(s.input_token_logprobs) + entries
        tops = list(s.input_top_logprobs or []) + tops
    choice: dict[str, Any] = {"index": s.index, "logprobs": None, "finish_reason": None}
    new_ids = _take_token_ids(s, choice) if opts.return_token_ids else False
    if opts.kind == "chat":
        choice["delta"] = {"content": text} if text else {}
        if entries:
            choice["logprobs"] = chat_logprobs(client, entries, tops)
    else:
        choice["text"] = text
        if entries:
            lp = completion_logprobs(client, entries, tops, text_offsets[s.index])
            text_offsets[s.index] += sum(len(t) for t in lp["tokens"])
            choice["logprobs"] = lp
    return choice, bool(text or entries or new_ids)


def _take_token_ids(s: SeqState, choice: dict) -> bool:
    """Put the output ids `s` made since the last chunk (and, in its first chunk, the prompt ids) in `choice`;
    whether there were any. Ids are never held back, even while text is (stop strings, partial UTF-8)."""
    sent = s.sent_token_ids
    if sent == 0 and s.output_ids:
        choice["prompt_token_ids"] = list(s.input_ids)
    choice["token_ids"] = s.output_ids[sent:]
    s.sent_token_ids = len(s.output_ids)
    return len(s.output_ids) > sent


def _split_tool_calls(opts: OpenAIOptions, text: str) -> tuple[Optional[str], list[ToolCall]]:
    """(message content, tool calls) of a whole reply; content is None when only calls were written."""
    parser = opts.tool_parser
    if parser is None:
        return text, []
    if opts.forced_tool_call:
        calls = parser.parse_forced(text)
        content = "" if calls else text
    else:
        content, calls = parser.parse(text)
    if not opts.parallel_tool_calls:
        calls = calls[:1]
    return (content if content.strip() or not calls else None), calls


def _stream_reasoning(choice: dict, reasoner: ReasoningStreamer, finished: bool) -> None:
    """Move a chat chunk's reasoning text into `delta.reasoning_content` (markers held back)."""
    delta = choice["delta"]
    reasoning, content = reasoner.feed(delta.pop("content", ""))
    if finished:
        more_reasoning, more_content = reasoner.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
    if reasoning:
        delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content


def _stream_tool_calls(choice: dict, streamer: Any, finished: bool, counts: dict[int, int], index: int,
                       parallel: bool) -> None:
    """Route a chat chunk's content through the tool-call streamer: content deltas and complete calls."""
    delta = choice["delta"]
    content, calls = streamer.feed(delta.pop("content", ""))
    if finished:
        rest, more = streamer.finish()
        content, calls = content + rest, calls + more
    if not parallel:
        calls = calls[:max(0, 1 - counts[index])]
    if content:
        delta["content"] = content
    if calls:
        first = counts[index]
        delta["tool_calls"] = [c.to_openai(first + k) for k, c in enumerate(calls)]
        counts[index] += len(calls)


def finish_reason(s: SeqState) -> Optional[str]:
    """OpenAI finish_reason: stop | length | abort (None while running)."""
    if not s.finished or s.finish_reason is None:
        return None
    return str(s.finish_reason.get("type", "stop"))


def matched_stop(s: SeqState) -> Any:
    """The stop string or token id that ended the sequence (SGLang's extension), if any."""
    if s.finished and s.finish_reason and s.finish_reason.get("type") == "stop":
        return s.finish_reason.get("matched")
    return None


def usage(states: list[SeqState]) -> dict:
    """Token counts; each prompt counted once however many sequences it has."""
    prompt, cached = {}, {}
    for s in states:
        prompt[s.prompt_index] = s.prompt_tokens
        cached[s.prompt_index] = max(cached.get(s.prompt_index, 0), s.cached_tokens)
    completion = sum(s.completion_tokens for s in states)
    return {"prompt_tokens": sum(prompt.values()), "completion_tokens": completion,
            "total_tokens": sum(prompt.values()) + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


def chat_logprobs(client: SchedulerClient, entries: list, tops: list) -> dict:
    """Chat `logprobs.content`: token, logprob, bytes and top_logprobs per generated token."""
    content = []
    for k, (lp, tid) in enumerate(entries):
        token = client.token_text(tid)
        top = tops[k] if k < len(tops) and tops[k] else []
        content.append({"token": token, "logprob": finite_logprob(lp), "bytes": list(token.encode("utf-8")),
                        "top_logprobs": [{"token": client.token_text(t), "logprob": finite_logprob(v),
                                          "bytes": list(client.token_text(t).encode("utf-8"))} for v, t in top]})
    return {"content": content}


def completion_logprobs(client: SchedulerClient, entries: list, tops: list, offset: int) -> dict:
    """Completions `logprobs`: tokens, token_logprobs, top_logprobs and text_offset lists."""
    tokens, token_lps, top_lps, offsets = [], [], [], []
    for k, (lp, tid) in enumerate(entries):
        token = client.token_text(tid)
        tokens.append(token)
        token_lps.append(finite_logprob(lp))
        top = tops[k] if k < len(tops) else None
        top_lps.append({client.token_text(t): finite_logprob(v) for v, t in top} if top else None)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top_lps, "text_offset": offsets}
