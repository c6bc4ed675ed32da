"""Constraints for the end-to-end server tests, each with an independent checker of the output text.

JSON schemas (and jsonschema's format checker, adjusted to what xgrammar enforces) are those of the
random-walk tests. Regexes are checked with Python's `re` (a full match) and, for outputs cut short by
max_new_tokens, with the `regex` package's partial matching (the text must still be a prefix of a
match); with DOTALL, as xgrammar's "." also matches a newline (see test_regex_walks). EBNF grammars are checked without xgrammar: by a Python regex for the regular ones, by Python's
own parser for arithmetic, by a bracket counter for balanced brackets.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import jsonschema
import regex as partial_re  # a dependency of transformers; has partial (prefix) matching

from tests.constrained.schemas import FORMAT_CHECKER, SCHEMAS

REGEXES: dict[str, str] = {
    "seed_braces": r"\{.*\}",                        # the seed's gen(regex=r'\{.*\}') example
    "braces_short": r"\{[a-z ]{0,12}\}",
    "phone": r"[0-9]{3}-[0-9]{4}",
    "yes_no": r"(yes|no|maybe)",
    "email": r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)",
    "iso_date": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "decimal": r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
    "hex_color": r"#[0-9a-fA-F]{6}",
    "full_name": r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8}){0,2}",
    "tuple": r"\((x|y|z)(,(x|y|z)){0,4}\)",
    "url": r"https?://[a-z]{2,10}\.(com|net)(/[a-z0-9]{1,8}){0,2}",
    "sentence": r"[A-Z][a-z ,]{0,30}[.!?]",
    "ipv4ish": r"([0-9]{1,3}\.){3}[0-9]{1,3}",
}

# name -> (grammar, checker of a complete output)
_ARITH = r'''root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [1-9] [0-9]? | "(" expr ")"'''
# Nested lists of digits, at most three items each: context-free, and short in practice.
_NESTED = r'''root ::= list
list ::= "[" (item ("," item){0,2})? "]"
item ::= [0-9] | list'''
_LIST = r'''root ::= "(" word ("," word)* ")"
word ::= [a-z] [a-z]? [a-z]?'''
_KV = r'''root ::= kv ("; " kv){0,3}
kv ::= key "=" value
key ::= "id" | "name" | "age"
value ::= [0-9]+ | "\"" [a-z]* "\""'''


def _is_arithmetic(text: str) -> bool:
    if not re.fullmatch(r"[0-9+\-*/()]+", text):
        return False
    try:
        ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    return True


def _is_nested_list(text: str) -> bool:
    def ok(value: object) -> bool:
        if isinstance(value, list):
            return len(value) <= 3 and all(ok(v) for v in value)
        return isinstance(value, int) and 0 <= value <= 9

    if not re.fullmatch(r"[0-9,\[\]]+", text):
        return False
    try:
        return ok(json.loads(text))
    except json.JSONDecodeError:
        return False


EBNF: dict[str, tuple[str, Callable[[str], bool]]] = {
    "arithmetic": (_ARITH, _is_arithmetic),
    "nested_lists": (_NESTED, _is_nested_list),
    "word_list": (_LIST, lambda t: re.fullmatch(r"\([a-z]{1,3}(,[a-z]{1,3})*\)", t) is not None),
    "key_values": (_KV, lambda t: re.fullmatch(r'(id|name|age)=([0-9]+|"[a-z]*")'
                                                r'(; (id|name|age)=([0-9]+|"[a-z]*")){0,3}', t) is not None),
}


@dataclass(frozen=True)
class Constraint:
    """One constraint as `/generate` takes it, and how to check a complete output against it."""

    kind: str      # "json_schema" | "regex" | "ebnf"
    name: str
    text: str

    def sampling_field(self) -> dict[str, str]:
        """The `sampling_params` entry that asks for this constraint."""
        return {self.kind: self.text}

    def check_complete(self, output: str) -> None:
        """Raise AssertionError (or a validation error) unless `output` satisfies the constraint."""
        assert "\ufffd" not in output, f"invalid UTF-8 in {output!r}"
        if self.kind == "json_schema":
            jsonschema.validate(json.loads(output), json.loads(self.text), format_checker=FORMAT_CHECKER)
        elif self.kind == "regex":
            assert re.fullmatch(self.text, output, re.DOTALL), f"{output!r} does not match {self.text!r}"
        else:
            assert EBNF[self.name][1](output), f"{output!r} does not parse under grammar {self.name}"

    def check_output(self, output: str, finish_type: str) -> None:
        """A stopped output satisfies the constraint; one cut at its token limit is a prefix of one."""
        if finish_type == "stop":
            self.check_complete(output)
        else:
            assert finish_type == "length", f"finished by {finish_type!r}: {output!r}"
            self.check_prefix(output)

    def check_prefix(self, output: str) -> None:
        """`output` (cut short) is valid UTF-8 but for its last character, and a prefix of a regex match."""
        output = output.rstrip("\ufffd")      # the last character may be cut in the middle of its bytes
        assert "\ufffd" not in output, f"invalid UTF-8 in {output!r}"
        if self.kind == "json_schema" and json.loads(self.text).get("type") == "object":
            assert output.lstrip()[:1] in ("", "{"), f"{output!r} does not start an object"
        if self.kind == "regex":
            assert partial_re.fullmatch(self.text, output, partial_re.DOTALL, partial=True), \
                f"{output!r} is not a prefix of a match of {self.text!r}"


def all_constraints() -> list[Constraint]:
    """Every schema, regex and grammar of the suite."""
    return ([Constraint("json_schema", n, json.dumps(s)) for n, s in sorted(SCHEMAS.items())]
            + [Constraint("regex", n, r) for n, r in REGEXES.items()]
            + [Constraint("ebnf", n, g) for n, (g, _) in EBNF.items()])
