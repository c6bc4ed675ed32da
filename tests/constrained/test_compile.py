"""Compilation: errors with the compiler's message, the compiled-grammar cache, off-caller compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from kvstrata.constrained import (
    GrammarError,
    create_grammar_backend,
    grammar_backend_names,
)
from kvstrata.constrained.xgrammar_backend import XGrammarBackend

INVALID = [
    ("regex", "a(b", "parenthesis is not closed"),
    ("regex", "[z-a]", "lower bound is larger than upper bound"),
    ("json_schema", "{bad json", "Failed to parse JSON"),
    ("json_schema", '{"type": "nonsense"}', 'Unsupported type "nonsense"'),
    ("json_schema", "[1, 2]", "Schema should be an object or bool"),
    ("json_schema", '{"$ref": "#/$defs/missing"}', "missing"),
    ("json_schema", '{"type": "string", "pattern": "a(b"}', "parenthesis is not closed"),
    ("ebnf", 'root ::= "a" | ', "Expect element"),
    ("ebnf", "root ::= undefined_rule", 'Rule "undefined_rule" is not defined'),
    ("ebnf", 'start ::= "a"', 'root rule with name "root" is not found'),
    ("sql", "SELECT 1", "unknown constraint kind"),
]


class GatedBackend(XGrammarBackend):
    """An xgrammar backend whose compiles wait for a gate, to observe what happens meanwhile."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.compiling = threading.Event()

    def _compile(self, kind, text):
        self.compiling.set()
        assert self.gate.wait(timeout=30), "test gate never opened"
        return super()._compile(kind, text)


@pytest.fixture
def gated(tokenizer, model_vocab_size):
    backend = GatedBackend(tokenizer, model_vocab_size, [tokenizer.eos_token_id], max_workers=1)
    yield backend
    backend.gate.set()
    backend.close()


@pytest.mark.parametrize(("kind", "text", "phrase"), INVALID)
def test_invalid_constraints_raise_grammar_error_with_the_compiler_message(backend, kind, text, phrase):
    with pytest.raises(GrammarError, match="invalid|unknown") as validated:
        backend.validate(kind, text)
    with pytest.raises(GrammarError) as compiled:
        backend.compile_async(kind, text).result(timeout=30)
    for error in (validated.value, compiled.value):
        message = str(error)
        assert phrase in message, message
        assert "/project/cpp" not in message and "Check failed" not in message
        assert isinstance(error, ValueError)  # servers map ValueError-derived GrammarError to HTTP 400


def test_backend_keeps_working_after_errors(backend, tokenizer):
    size_before = backend.cache_info().size
    for kind, text, _ in INVALID:
        with pytest.raises(GrammarError):
            backend.compile(kind, text)
    assert backend.cache_info().size == size_before, "failed compiles must not stay cached"
    grammar = backend.compile("regex", "ok")
    for token in tokenizer.encode("ok", add_special_tokens=False):
        assert grammar.accept_token(token)
    assert grammar.accept_token(tokenizer.eos_token_id)


def test_valid_constraints_validate(backend):
    backend.validate("regex", r"\{.*\}")
    backend.validate("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "string"}}}))
    backend.validate("json_object", "")
    backend.validate("ebnf", 'root ::= "a"+')


def test_non_string_constraint_is_rejected(backend):
    with pytest.raises(GrammarError, match="must be a string"):
        backend.validate("json_schema", {"type": "object"})


def test_same_constraint_compiles_once(backend):
    text = json.dumps({"type": "object", "properties": {"cached": {"type": "integer"}}})
    before = backend.cache_info()
    first = backend.compile("json_schema", text)
    second = backend.compile("json_schema", text)
    after = backend.cache_info()
    assert after.compiles - before.compiles == 1
    assert after.misses - before.misses == 1 and after.hits - before.hits == 1
    assert first is not second, "each request gets its own matcher"


def test_concurrent_requests_for_one_constraint_share_one_compile(gated):
    futures = [gated.compile_async("regex", "[0-9]{3}") for _ in range(4)]
    assert gated.compiling.wait(timeout=30)
    gated.gate.set()
    grammars = [f.result(timeout=30) for f in futures]
    assert len({id(g) for g in grammars}) == 4
    info = gated.cache_info()
    assert (info.compiles, info.misses, info.hits) == (1, 1, 3)


def test_compile_async_returns_before_the_compile_ends(gated):
    gated.gate.set()
    gated.compile("regex", "cached")
    gated.gate.clear()
    pending = gated.compile_async("json_schema", '{"type": "string"}')
    assert gated.compiling.wait(timeout=30)
    assert not pending.done(), "the caller must not wait for the compile"
    # While the only compile thread is busy, a cached grammar is still served at once.
    cached = gated.compile_async("regex", "cached")
    assert cached.done() and cached.result() is not None
    gated.gate.set()
    assert pending.result(timeout=30) is not None


def test_cache_is_bounded_lru(tokenizer, model_vocab_size):
    backend = XGrammarBackend(tokenizer, model_vocab_size, [tokenizer.eos_token_id], cache_size=2)
    try:
        for text in ("a", "b", "a", "c"):  # "a" is touched again, so "b" is the least recently used
            backend.compile("regex", text)
        assert backend.cache_info().compiles == 3 and backend.cache_info().size == 2
        backend.compile("regex", "a")
        assert backend.cache_info().compiles == 3
        backend.compile("regex", "b")
        assert backend.cache_info().compiles == 4
        backend.clear_cache()
        backend.compile("regex", "a")
        assert backend.cache_info().compiles == 5
    finally:
        backend.close()


def test_close_cancels_queued_compiles(gated):
    running = gated.compile_async("regex", "first")
    queued = gated.compile_async("regex", "second")
    assert gated.compiling.wait(timeout=30)
    opener = threading.Timer(0.05, gated.gate.set)  # opens the gate while close() waits for "first"
    opener.start()
    try:
        gated.close()
    finally:
        opener.cancel()
    assert running.result(timeout=30) is not None
    assert queued.cancelled()


def test_registry(tokenizer, model_vocab_size):
    assert create_grammar_backend("none", tokenizer, model_vocab_size, [tokenizer.eos_token_id]) is None
    assert set(grammar_backend_names()) >= {"xgrammar", "none"}
    with pytest.raises(ValueError, match="unknown grammar backend 'outlines'"):
        create_grammar_backend("outlines", tokenizer, model_vocab_size, [tokenizer.eos_token_id])
    backend = create_grammar_backend("xgrammar", tokenizer, model_vocab_size, [], max_workers=2)
    try:
        assert isinstance(backend, XGrammarBackend)
        assert backend.eos_token_ids == [tokenizer.eos_token_id], "eos defaults to the tokenizer's"
    finally:
        backend.close()


def test_xgrammar_loads_on_the_first_constraint_not_before():
    # In a fresh interpreter: creating the backend (as the scheduler does at start) must not import xgrammar (and so
    # not scan the vocabulary); the first compile does, off the caller's thread, and then works as before.
    code = (
        "import sys\n"
        "from tests.constrained.conftest import build_tokenizer\n"
        "from kvstrata.constrained import create_grammar_backend\n"
        "tok = build_tokenizer()\n"
        "backend = create_grammar_backend('xgrammar', tok, len(tok), [tok.eos_token_id])\n"
        "assert 'xgrammar' not in sys.modules, 'xgrammar imported at start'\n"
        "grammar = backend.compile('regex', 'ab')\n"
        "assert 'xgrammar' in sys.modules\n"
        "assert not grammar.is_terminated()\n"
        "backend.close()\n"
        "print('ok')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
