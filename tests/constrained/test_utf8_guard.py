"""Surrogates (UTF-8 bytes ED A0..BF ..) never get into constrained output, whatever the grammar."""

from __future__ import annotations

import json

import pytest

from kvstrata.constrained.bitmask import unpack_bitmask


def _byte_token(backend, value: int) -> int:
    """The id of the single-byte token `value` (the test tokenizer has all 256 bytes)."""
    return [bytes(b) for b in backend.tokenizer_info.decoded_vocab].index(bytes([value]))


@pytest.mark.parametrize("kind, text, prefix", [
    ("regex", r"\{.*\}", "{"),
    ("regex", r"[^\n]{1,12}", ""),
    ("json_schema", json.dumps({"type": "string", "maxLength": 6}), '"'),
    ("json_schema", json.dumps({"type": "object", "properties": {"s": {"type": "string"}}}), '{"s": "'),
])
def test_after_a_bare_ed_byte_only_non_surrogate_continuations(backend, tokenizer, kind, text, prefix):
    grammar = backend.compile(kind, text)
    for token in tokenizer.encode(prefix, add_special_tokens=False):
        assert grammar.accept_token(token)
    ed, surrogate_second, valid_second = (_byte_token(backend, b) for b in (0xED, 0xA0, 0x9F))
    assert grammar.accept_token(ed)
    mask = backend.allocate_bitmask(1)
    grammar.fill_bitmask(mask, 0)
    allowed = unpack_bitmask(mask, backend.vocab_size)[0]
    assert not allowed[surrogate_second] and allowed[valid_second]
    assert not grammar.accept_token(surrogate_second)
    assert grammar.accept_token(valid_second)     # U+D7C0..U+D7FF: a real character


def test_rollback_restores_the_lead_byte_state(backend, tokenizer):
    grammar = backend.compile("regex", r"\{.*\}")
    ed, surrogate_second, valid_second = (_byte_token(backend, b) for b in (0xED, 0xA0, 0x9F))
    for token in tokenizer.encode("{", add_special_tokens=False) + [ed, valid_second]:
        assert grammar.accept_token(token)
    grammar.rollback(1)                            # back to "{" + ED: a surrogate must still be refused
    assert not grammar.accept_token(surrogate_second)
    grammar.rollback(1)                            # back to "{": any byte may start a character again
    assert grammar.accept_token(ed)
