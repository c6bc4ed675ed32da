"""Constrained decoding: grammar backends (regex, JSON schema, EBNF) producing token bitmasks."""

from kvstrata.constrained.base import GRAMMAR_KINDS, Grammar, GrammarBackend, GrammarError
from kvstrata.constrained.compile_cache import GrammarCacheInfo
from kvstrata.constrained.registry import (
    create_grammar_backend,
    grammar_backend_names,
    register_grammar_backend,
)

__all__ = [
    "GRAMMAR_KINDS",
    "Grammar",
    "GrammarBackend",
    "GrammarCacheInfo",
    "GrammarError",
    "create_grammar_backend",
    "grammar_backend_names",
    "register_grammar_backend",
]
