"""Pieces of kvstrata.lang that need no runtime: chat-template segments, choices methods, tracing, sampling."""

from __future__ import annotations

import math

import pytest

import kvstrata.lang as sgl
from kvstrata.lang.chat_template import ChatTemplateError, RoleRenderer
from kvstrata.lang.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from kvstrata.lang.sampling import SamplingArgs, normalize_overrides
from kvstrata.lang.tracer import trace_prefix
from kvstrata.model.tokenizer import load_tokenizer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "How are pages cached?"},
    {"role": "assistant", "content": "In a radix tree."},
]


def _render_by_segments(renderer: RoleRenderer, messages: list[dict]) -> str:
    text, history = "", []
    for m in messages:
        prefix, suffix = renderer.segment(m["role"], history)
        text += prefix + m["content"] + suffix
        history.append(m)
    return text


@pytest.mark.parametrize("model", ["tiny", "bench"])
def test_segments_rebuild_the_template(model):
    tok = load_tokenizer(model)
    renderer = RoleRenderer(tok)
    expected = tok.apply_chat_template(CONVERSATION, tokenize=False)
    if tok.bos_token and tok.encode("a", add_special_tokens=True)[0] == tok.bos_token_id:
        # The backend's tokenization adds the BOS, so the program text leaves it out.
        assert expected.startswith(tok.bos_token)
        expected = expected[len(tok.bos_token):]
    assert _render_by_segments(renderer, CONVERSATION) == expected
    # Starting with a user message works too (no system prompt).
    assert _render_by_segments(renderer, CONVERSATION[1:3]) == renderer.render(CONVERSATION[1:3]).removeprefix(
        tok.bos_token or "")


def test_assistant_prefix_is_the_generation_prompt():
    tok = load_tokenizer("tiny")
    renderer = RoleRenderer(tok)
    history = CONVERSATION[:2]
    prompt = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    prefix, _ = renderer.segment("assistant", history)
    assert renderer.render(history) + prefix == prompt


def test_a_template_that_rewrites_history_falls_back():
    tok = load_tokenizer("tiny")
    # Puts the system prompt last: the history is never a prefix of a longer conversation.
    odd = ("{% for m in messages if m.role != 'system' %}[{{ m.role }}]{{ m.content }}[/]{% endfor %}"
           "{% for m in messages if m.role == 'system' %}<sys>{{ m.content }}</sys>{% endfor %}")
    renderer = RoleRenderer(tok, chat_template=odd)
    assert renderer.segment("user", [{"role": "system", "content": "x"}]) == ("[user]", "[/]")
    with pytest.raises(ChatTemplateError):
        RoleRenderer(tok, chat_template="{{ raise_exception('no roles here') }}").segment("user", [])


def test_no_chat_template_is_a_clear_error():
    class Bare:
        chat_template = None

    with pytest.raises(ChatTemplateError, match="no chat template"):
        RoleRenderer(Bare())


def test_choices_methods():
    cond = [[-1.0, -1.0], [-0.5, -3.0, -3.0], [None, -2.0]]
    assert token_length_normalized.decide(cond).index == 0
    assert token_length_normalized.decide(cond).scores == pytest.approx([-1.0, -6.5 / 3, -2.0])
    # Greedy: the best first token wins.
    assert greedy_token_selection.decide(cond).index == 1
    # Ties on the first token are broken by the next one; a shorter choice is padded with its mean.
    assert greedy_token_selection.decide([[-1.0, -2.0, -0.1], [-1.0, -1.9]]).index == 1
    uncond = [[-0.5, -0.5], [-5.0, -5.0, -5.0], [None, -2.0]]
    decision = unconditional_likelihood_normalized.decide(cond, uncond)
    assert decision.scores == pytest.approx([-0.5, (4.5 + 2 + 2) / 3, 0.0])
    assert decision.index == 1
    assert token_length_normalized.decide([[None], [None]]).scores == [-math.inf, -math.inf]


def test_sampling_overrides():
    assert normalize_overrides(max_tokens=5, stop="\n", dtype="int") == {
        "max_new_tokens": 5, "stop": ("\n",), "regex": r"-?\d+"}
    assert normalize_overrides(json_schema={"type": "integer"}) == {"json_schema": '{"type": "integer"}'}
    args = SamplingArgs(json_schema='{"type": "integer"}').merge({"regex": "a"})
    assert args.regex == "a" and args.json_schema is None
    assert args.sampling_params()["regex"] == "a"
    assert SamplingArgs(return_logprob=True, logprob_start_len=3).logprob_args()["logprob_start_len"] == 3
    with pytest.raises(TypeError, match="unknown sampling argument"):
        normalize_overrides(temprature=0.5)


class _TemplateOnly(sgl.Backend):
    """A backend that can only render chat templates: enough for tracing."""

    def __init__(self):
        super().__init__()

    def _load_tokenizer(self):
        return load_tokenizer("tiny")

    generate = generate_stream = prompt_logprobs = cache_prefix = flush_cache = get_server_info = None


def test_trace_prefix_stops_at_arguments_and_generation():
    backend = _TemplateOnly()

    def program(s, question, style="short"):
        s += sgl.system(f"Answer in a {style} way.")
        s += "Context: caches.\n"
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("a"))

    prefix = trace_prefix(program, backend, ["question"])
    assert prefix == "<|im_start|>system\nAnswer in a short way.<|im_end|>\nContext: caches.\n"
    assert trace_prefix(program, backend, ["question", "style"]) == ""

    def branching(s, flag):
        s += "Always here. "
        if flag:
            s += "Sometimes here."

    assert trace_prefix(branching, backend, ["flag"]) == "Always here. "

    def generates_first(s, question):
        s += "Q:" + sgl.gen("x")

    assert trace_prefix(generates_first, backend, ["question"]) == "Q:"
