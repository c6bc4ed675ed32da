"""Random-model decoding under regexes: every output that ends matches its regex."""

from __future__ import annotations

import re

import pytest

from tests.constrained.random_walk import run_walks

WALKS_PER_REGEX = 6

_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"

REGEXES = [
    r"\{.*\}",  # the seed's example: gen('json_output', max_tokens=100, regex=r'\{.*\}')
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)",
    r"true|false",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)",
    r"\d{4}-\d{2}-\d{2}",
    r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
    r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8}){0,2}",
    r"https?://[a-z]{1,10}\.[a-z]{2,3}(/[a-z0-9]{1,6}){0,3}",
    rf"({_OCTET}\.){{3}}{_OCTET}",
    r"#[0-9a-fA-F]{6}",
    r'\[("[a-z]{1,5}", ){0,3}"[a-z]{1,5}"\]',
    r"[^\n]{1,12}",  # a negated class: any character, multi-byte ones included, must stay whole
    r"(ab|cd)*e",
    r"\s?[a-z]{2,5}\s?",
    r"\w+ \w+",
]


@pytest.mark.parametrize("pattern", REGEXES)
def test_outputs_match_regex(pattern, backend, tokenizer, bias):
    walks = run_walks(backend, "regex", pattern, tokenizer, bias, WALKS_PER_REGEX, seed=len(pattern))
    finished = [w for w in walks if w.terminated]
    assert len(finished) >= WALKS_PER_REGEX // 2, f"too few walks ended: {[w.text for w in walks]}"
    # xgrammar's "." also matches a newline (Python's needs DOTALL); \d, \w, \s are ASCII in xgrammar,
    # a subset of Python's Unicode classes, so the Python check is at least as permissive.
    compiled = re.compile(pattern, re.DOTALL)
    for walk in finished:
        assert "\ufffd" not in walk.text, f"a multi-byte character was cut: {walk.text!r}"
        assert compiled.fullmatch(walk.text), f"{walk.text!r} does not match {pattern!r}"


def test_seed_example_without_dotall_can_span_lines(backend, tokenizer):
    """Documents xgrammar's "." semantics: it accepts a newline, unlike Python's default."""
    grammar = backend.compile("regex", r"\{.*\}")
    for token in tokenizer.encode("{a\nb}", add_special_tokens=False):
        assert grammar.accept_token(token)
    assert grammar.accept_token(tokenizer.eos_token_id)
    assert grammar.is_terminated()
