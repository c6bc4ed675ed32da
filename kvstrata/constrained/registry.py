"""Grammar backends by name (`--grammar-backend`): "xgrammar", "none", and any registered later."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from kvstrata.constrained.base import GrammarBackend

BackendFactory = Callable[..., GrammarBackend]

_FACTORIES: dict[str, BackendFactory] = {}


def register_grammar_backend(name: str, factory: BackendFactory) -> None:
    """Make `create_grammar_backend(name, ...)` call `factory(tokenizer, vocab_size, eos_token_ids, **kw)`."""
    if name == "none":
        raise ValueError('"none" is reserved: it means constrained decoding is off')
    _FACTORIES[name] = factory


def grammar_backend_names() -> list[str]:
    """Every accepted `--grammar-backend` value."""
    return sorted(_FACTORIES) + ["none"]


def create_grammar_backend(name: str, tokenizer: Any, vocab_size: int, eos_token_ids: Optional[list[int]],
                           **kwargs: Any) -> Optional[GrammarBackend]:
    """The backend called `name`, or None for "none" (requests with constraints are then rejected)."""
    if name == "none":
        return None
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown grammar backend {name!r}; choose from {', '.join(grammar_backend_names())}")
    return factory(tokenizer, vocab_size, list(eos_token_ids or []), **kwargs)


def _xgrammar(tokenizer: Any, vocab_size: int, eos_token_ids: list[int], **kwargs: Any) -> GrammarBackend:
    # Imported on use: xgrammar is only loaded by processes that constrain decoding.
    from kvstrata.constrained.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(tokenizer, vocab_size, eos_token_ids, **kwargs)


register_grammar_backend("xgrammar", _xgrammar)
