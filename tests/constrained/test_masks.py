"""Bitmask filling and applying: mixed batches, padded vocab, special tokens, eos, rollback, copy."""

from __future__ import annotations

import pytest
import torch

from kvstrata.constrained import GrammarBackend
from kvstrata.constrained.bitmask import allow_only, disallow, keep_mask, unpack_bitmask
from tests.constrained.conftest import IM_START


def _allowed(backend, grammar) -> torch.Tensor:
    bitmask = backend.allocate_bitmask(1)
    grammar.fill_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, backend.vocab_size)[0]


def _accept_text(grammar, tokenizer, text: str) -> None:
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert grammar.accept_token(token), f"rejected a token of {text!r}"


def test_bitmask_bit_helpers_cover_word_edges():
    vocab = 100
    bitmask = torch.full((2, 4), -1, dtype=torch.int32)
    allow_only(bitmask, 1, [0, 31, 32, 63, 99])
    assert unpack_bitmask(bitmask, vocab)[1].nonzero().flatten().tolist() == [0, 31, 32, 63, 99]
    disallow(bitmask, 0, [5, 31, 63])
    row = unpack_bitmask(bitmask, vocab)[0]
    assert not row[[5, 31, 63]].any() and row.sum() == vocab - 3
    keep = keep_mask(vocab, [1, 95])
    assert unpack_bitmask(keep, vocab).logical_not().nonzero().flatten().tolist() == [1, 95]


def test_allocate_bitmask_allows_everything(backend):
    bitmask = backend.allocate_bitmask(3)
    assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu"
    assert bitmask.shape == (3, (backend.vocab_size + 31) // 32)
    assert unpack_bitmask(bitmask, backend.vocab_size).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_masks_only_constrained_rows(backend, tokenizer, dtype):
    grammars = {1: backend.compile("regex", r"(yes|no)"), 3: backend.compile("json_schema", '{"type": "integer"}')}
    bitmask = backend.allocate_bitmask(4)
    for row, grammar in grammars.items():
        grammar.fill_bitmask(bitmask, row)
    logits = torch.randn(4, backend.vocab_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    original = logits.clone()
    backend.apply_bitmask(logits, bitmask, torch.tensor([1, 3]))
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    allowed = unpack_bitmask(bitmask, backend.vocab_size)
    for row in grammars:
        assert torch.isneginf(logits[row][~allowed[row]]).all()
        assert torch.equal(logits[row][allowed[row]], original[row][allowed[row]])
        assert 0 < allowed[row].sum() < backend.vocab_size // 4
    # The generic torch implementation (any device) gives the same result as xgrammar's kernel.
    reference = original.clone()
    GrammarBackend.apply_bitmask(reference, bitmask, torch.tensor([1, 3]))
    assert torch.equal(reference, logits)


def test_apply_bitmask_without_rows_and_with_no_rows(backend):
    bitmask = backend.allocate_bitmask(2)
    allow_only(bitmask, 0, [7])
    allow_only(bitmask, 1, [8, 9])
    logits = torch.zeros(2, backend.vocab_size)
    backend.apply_bitmask(logits, bitmask, torch.tensor([], dtype=torch.long))
    assert not torch.isinf(logits).any()
    backend.apply_bitmask(logits, bitmask)
    assert torch.isfinite(logits).nonzero().tolist() == [[0, 7], [1, 8], [1, 9]]


def test_mixed_batch_decodes_like_each_request_alone(backend, tokenizer):
    """Greedy decoding: requests sharing a bitmask and a logits batch get what they get alone."""
    constraints = [("regex", r"[a-z]{2,6}@[a-z]{2,5}\.com"), None, ("json_schema", '{"type": "boolean"}'),
                   None, ("ebnf", 'root ::= "<" [0-9]+ ">"')]

    def logits_for(request: int, step: int) -> torch.Tensor:
        return torch.randn(backend.vocab_size, generator=torch.Generator().manual_seed(request * 997 + step))

    def decode(requests: list[int], steps: int = 12) -> dict[int, list[int]]:
        grammars = {r: backend.compile(*constraints[r]) for r in requests if constraints[r]}
        rows = torch.tensor([i for i, r in enumerate(requests) if r in grammars])
        bitmask = backend.allocate_bitmask(len(requests))
        out: dict[int, list[int]] = {r: [] for r in requests}
        for step in range(steps):
            logits = torch.stack([logits_for(r, step) for r in requests])
            for i, r in enumerate(requests):
                if r in grammars:
                    grammars[r].fill_bitmask(bitmask, i)
            backend.apply_bitmask(logits, bitmask, rows)
            for i, r in enumerate(requests):
                token = int(logits[i].argmax())
                if r in grammars and not grammars[r].is_terminated():
                    assert grammars[r].accept_token(token)
                out[r].append(token)
        return out

    together = decode(list(range(len(constraints))))
    for request in range(len(constraints)):
        assert decode([request]) == {request: together[request]}


def test_padding_and_special_tokens_are_never_allowed(backend, tokenizer):
    im_start = tokenizer.convert_tokens_to_ids(IM_START)
    grammar = backend.compile("regex", r".{1,40}")
    for prefix in ["", "ab", "<|im"]:
        g = grammar.copy()
        _accept_text(g, tokenizer, prefix)
        allowed = _allowed(backend, g)
        assert not allowed[len(tokenizer):].any()
        assert not allowed[im_start]
        assert not g.accept_token(im_start)
        assert not g.accept_token(len(tokenizer) + 3)


def test_eos_only_once_the_match_is_complete(backend, tokenizer):
    """xgrammar alone would accept eos here, reading "<|im_end|>" as text that completes `[^\\n]{1,12}`."""
    eos = tokenizer.eos_token_id
    grammar = backend.compile("regex", r"[^\n]{1,12}")
    assert not _allowed(backend, grammar)[eos]
    assert not grammar.accept_token(eos) and not grammar.is_terminated()
    _accept_text(grammar, tokenizer, "x")
    assert _allowed(backend, grammar)[eos]
    assert grammar.accept_token(eos) and grammar.is_terminated()


def test_terminated_grammar_allows_only_eos(backend, tokenizer):
    grammar = backend.compile("regex", "abc")
    _accept_text(grammar, tokenizer, "abc")
    assert _allowed(backend, grammar).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert grammar.accept_token(tokenizer.eos_token_id)
    assert grammar.is_terminated()
    assert _allowed(backend, grammar).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert not grammar.accept_token(tokenizer.encode("a")[0])


def test_rollback_restores_the_earlier_mask(backend, tokenizer):
    grammar = backend.compile("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    tokens = tokenizer.encode('{"a": 12', add_special_tokens=False)
    assert len(tokens) >= 3
    masks = [_allowed(backend, grammar)]
    for token in tokens:
        assert grammar.accept_token(token)
        masks.append(_allowed(backend, grammar))
    grammar.rollback(2)
    assert torch.equal(_allowed(backend, grammar), masks[-3])
    grammar.rollback(0)
    assert torch.equal(_allowed(backend, grammar), masks[-3])


def test_copy_is_fresh_and_independent(backend, tokenizer):
    grammar = backend.compile("regex", r"(cat|dog)s?")
    _accept_text(grammar, tokenizer, "cat")
    fresh = grammar.copy()
    assert torch.equal(_allowed(backend, fresh), _allowed(backend, backend.compile("regex", r"(cat|dog)s?")))
    _accept_text(fresh, tokenizer, "do")
    assert grammar.accept_token(tokenizer.eos_token_id) and grammar.is_terminated()
    assert not fresh.is_terminated()


def test_bounded_json_strings_refuse_raw_control_characters(backend, tokenizer):
    """xgrammar 0.2.9 lets a raw tab into a string with maxLength; JSON forbids it (we rewrite the rule)."""
    schema = '{"type": "object", "properties": {"s": {"type": "string", "maxLength": 6}}, "required": ["s"]}'
    grammar = backend.compile("json_schema", schema)
    _accept_text(grammar, tokenizer, '{"s": "a')
    allowed = _allowed(backend, grammar)
    for char in "\t\x01\x1f":
        (token,) = tokenizer.encode(char, add_special_tokens=False)
        assert not allowed[token], repr(char)
    (letter,) = tokenizer.encode("b", add_special_tokens=False)
    assert allowed[letter]


@pytest.mark.gpu
@pytest.mark.gpu
def test_apply_bitmask_on_cuda_matches_cpu(backend):
    generator = torch.Generator().manual_seed(1)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, backend.allocate_bitmask(1).shape[1]), dtype=torch.int32,
                            generator=generator)
    logits = torch.randn(4, backend.vocab_size, generator=generator)
    rows = torch.tensor([0, 2])
    expected = logits.clone()
    backend.apply_bitmask(expected, bitmask, rows)
    for apply in (backend.apply_bitmask, GrammarBackend.apply_bitmask):
        on_device = logits.cuda()
        apply(on_device, bitmask, rows.cuda())  # the bitmask stays on the CPU, as the scheduler fills it
        assert torch.equal(on_device.cpu(), expected)
