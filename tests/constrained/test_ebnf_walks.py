"""Random-model decoding under EBNF grammars: every output that ends is in the grammar's language."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from tests.constrained.random_walk import run_walks

WALKS_PER_GRAMMAR = 6


class _Parser:
    """A recursive-descent reader over a string; each grammar's checker is written with it."""

    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def eat(self, literal: str) -> bool:
        if self.text.startswith(literal, self.pos):
            self.pos += len(literal)
            return True
        return False

    def eat_re(self, pattern: str) -> bool:
        match = re.compile(pattern).match(self.text, self.pos)
        if match is None:
            return False
        self.pos = match.end()
        return True

    def done(self) -> bool:
        return self.pos == len(self.text)


def _is_arithmetic(text: str) -> bool:
    p = _Parser(text)

    def expr() -> bool:
        if not term():
            return False
        while p.eat("+") or p.eat("-"):
            if not term():
                return False
        return True

    def term() -> bool:
        if not factor():
            return False
        while p.eat("*"):
            if not factor():
                return False
        return True

    def factor() -> bool:
        if p.eat("("):
            return expr() and p.eat(")")
        return p.eat_re(r"[0-9]{1,3}")

    return expr() and p.done()


def _is_nested_list(text: str) -> bool:
    p = _Parser(text)

    def a_list() -> bool:
        if not p.eat("["):
            return False
        if p.eat("]"):
            return True
        if not item():
            return False
        while p.eat(","):
            if not item():
                return False
        return p.eat("]")

    def item() -> bool:
        return p.eat_re(r"[a-z]{1,4}") or a_list()

    return a_list() and p.done()


def _is_a_n_b_a_n(text: str) -> bool:
    n = (len(text) - 1) // 2
    return len(text) % 2 == 1 and text == "a" * n + "b" + "a" * n


GRAMMARS: dict[str, tuple[str, Callable[[str], bool]]] = {
    "arithmetic": (
        'root ::= expr\n'
        'expr ::= term (("+" | "-") term)*\n'
        'term ::= factor ("*" factor)*\n'
        'factor ::= [0-9] | [0-9] [0-9] | [0-9] [0-9] [0-9] | "(" expr ")"\n',
        _is_arithmetic),
    "nested_lists": (
        'root ::= list\n'
        'list ::= "[" "]" | "[" item ("," item)* "]"\n'
        'item ::= [a-z] | [a-z] [a-z] | [a-z] [a-z] [a-z] | [a-z] [a-z] [a-z] [a-z] | list\n',
        _is_nested_list),
    "a_n_b_a_n": ('root ::= "a" root "a" | "b"\n', _is_a_n_b_a_n),
    "key_value_lines": (
        'root ::= pair ("\\n" pair)?  ("\\n" pair)?\n'
        'pair ::= [a-z]+ "=" [0-9]+\n',
        lambda s: re.fullmatch(r"[a-z]+=[0-9]+(\n[a-z]+=[0-9]+){0,2}", s) is not None),
    "answer_with_reason": (
        'root ::= ("yes" | "no") ", because " [a-z ]{1,20} "."\n',
        lambda s: re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", s) is not None),
    "csv_row": (
        'root ::= field ("," field)* "\\n"\n'
        'field ::= [0-9]+ | "\\"" [a-zA-Z ]* "\\""\n',
        lambda s: re.fullmatch(r'([0-9]+|"[a-zA-Z ]*")(,([0-9]+|"[a-zA-Z ]*"))*\n', s) is not None),
}


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_outputs_parse_under_grammar(name, backend, tokenizer, bias):
    grammar, in_language = GRAMMARS[name]
    walks = run_walks(backend, "ebnf", grammar, tokenizer, bias, WALKS_PER_GRAMMAR, seed=len(name))
    finished = [w for w in walks if w.terminated]
    assert len(finished) >= WALKS_PER_GRAMMAR // 2, f"too few walks ended: {[w.text for w in walks]}"
    for walk in finished:
        assert in_language(walk.text), f"{walk.text!r} is not in the language of {name}"


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_checkers_reject_near_misses(name):
    """The language checkers above are not vacuous."""
    near_misses = {"arithmetic": ["1+", "(1", "1234", ""], "nested_lists": ["[a,]", "[[a]", "[abcde]"],
                   "a_n_b_a_n": ["aab", "aba a", ""], "key_value_lines": ["a=", "a=1\n", "=1"],
                   "answer_with_reason": ["yes, because x", "maybe, because x."],
                   "csv_row": ["1,2", '"a,1\n']}
    _, in_language = GRAMMARS[name]
    for text in near_misses[name]:
        assert not in_language(text), text
