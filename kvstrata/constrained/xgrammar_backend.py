"""The xgrammar backend: regex, JSON schema, JSON object and EBNF constraints as token bitmasks.

xgrammar is imported, and its tables of the vocabulary built, on the first constraint (in the compile pool,
so the scheduler keeps stepping): a server whose clients never constrain output does not carry them (~45 MB
of xgrammar, transformers and Pillow in the scheduler process), and the first constrained request waits for
the vocabulary scan as vLLM's do.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import threading
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from kvstrata.constrained import bitmask as bitmask_ops
from kvstrata.constrained.base import Grammar, GrammarBackend
from kvstrata.constrained.utf8_guard import SurrogateGuard
from kvstrata.model.light_tokenizer import LightTokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

# OpenAI json_object mode: any JSON object. strict_mode=False lets it hold any properties.
_ANY_OBJECT_SCHEMA = '{"type": "object"}'

# xgrammar 0.2.9 writes the characters of a length-bounded JSON string (minLength/maxLength) as this
# class, which lets raw control characters (tab, NUL...) into the string: JSON forbids them. We
# rewrite it to exclude all control characters (bounded strings still take no escape sequences).
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'

# Whitespace between JSON tokens by default: compact, a space or two, or one line break with indentation.
# xgrammar's own `[ \n\r\t]*` lets a small model loop on blank lines until max_tokens (finish "length").
DEFAULT_JSON_WHITESPACE = r"(\n[ \t]{0,12}|[ \t]{0,2})"
_XGRAMMAR_ANY_WHITESPACE = r"[ \n\r\t]*"
_WS_RULE_PREFIX = "json_ws_"

# xgrammar's kernels: C++ on CPU, Triton on CUDA; anywhere else our torch version is the safe choice.
_HAS_TRITON = importlib.util.find_spec("triton") is not None


class XGrammarGrammar(Grammar):
    """One request's xgrammar matcher.

    eos is allowed only once the text so far is a complete match. xgrammar 0.2.9 also allows (and
    accepts) a stop token whose *text* (e.g. "<|im_end|>") would complete the grammar, as if it were
    part of the output: `[^\\n]+` could then end with no output at all. Our requests end at eos and
    the eos text is not output, so that case must be refused.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, eos_token_ids: list[int],
                 keep_mask: Optional[torch.Tensor] = None, guard: Optional[SurrogateGuard] = None):
        self._compiled = compiled
        self._eos_token_ids = eos_token_ids
        self._keep_mask = keep_mask
        self._guard = guard
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        # Per accepted token (and one for the start): does the text end with a bare UTF-8 lead byte ED?
        self._after_lead = [False]

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False if the grammar does not allow it (or it already ended)."""
        if self._matcher.is_terminated():
            return False
        if token_id in self._eos_token_ids and not self._matcher.is_completed():
            return False
        if self._keep_mask is not None and not _bit_set(self._keep_mask, token_id):
            return False
        if self._guard is not None and not self._guard.allows(self._after_lead[-1], token_id):
            return False
        if not self._matcher.accept_token(int(token_id)):
            return False
        if self._guard is not None:
            self._after_lead.append(self._guard.next_state(self._after_lead[-1], token_id))
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]`; only eos once the grammar has ended."""
        if self._matcher.is_terminated():
            # xgrammar refuses to compute a mask after the stop token; a request still in the batch
            # for one more step may only end.
            bitmask_ops.allow_only(bitmask, row, self._eos_token_ids)
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._keep_mask is not None:
            bitmask[row] &= self._keep_mask
        if self._guard is not None:
            self._guard.restrict(bitmask, row, self._after_lead[-1])
        if not self._matcher.is_completed():
            bitmask_ops.disallow(bitmask, row, self._eos_token_ids)

    def is_terminated(self) -> bool:
        """True once an eos token was accepted."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """True when the text so far is a complete match (eos would be accepted now)."""
        return self._matcher.is_completed()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)
            if self._guard is not None:
                del self._after_lead[max(1, len(self._after_lead) - num_tokens):]

    def copy(self) -> XGrammarGrammar:
        """A fresh matcher of the same compiled grammar."""
        return XGrammarGrammar(self._compiled, self._eos_token_ids, self._keep_mask, self._guard)


class _Tables(NamedTuple):
    """What the backend builds from the vocabulary on first use."""

    info: xgr.TokenizerInfo
    guard: SurrogateGuard
    keep_mask: Optional[torch.Tensor]
    compiler: xgr.GrammarCompiler


class XGrammarBackend(GrammarBackend):
    """Grammar backend on xgrammar's compiler and matcher.

    `any_whitespace` lets JSON output use whitespace between tokens (as models trained on pretty JSON
    write it): each run matches `whitespace_pattern` (a regex; None: DEFAULT_JSON_WHITESPACE), and
    `max_whitespace_cnt` bounds its length. `any_whitespace=False` allows compact JSON only.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], max_workers: int = 1,
                 cache_size: int = 256, any_whitespace: bool = True,
                 max_whitespace_cnt: Optional[int] = None, compile_threads: Optional[int] = None,
                 whitespace_pattern: Optional[str] = None):
        super().__init__(tokenizer, vocab_size, eos_token_ids, max_workers, cache_size)
        self._any_whitespace = any_whitespace
        self._max_whitespace_cnt = max_whitespace_cnt
        self._whitespace_pattern = whitespace_pattern
        self._whitespace_rules: Optional[str] = None
        self._compile_threads = compile_threads
        self._tables_lock = threading.Lock()
        self._built: Optional[_Tables] = None

    @property
    def tokenizer_info(self) -> xgr.TokenizerInfo:
        """xgrammar's tables of the vocabulary (built on first use)."""
        return self._tables().info

    def _tables(self) -> _Tables:
        """The vocabulary tables, masks and compiler, built once, on the first constraint."""
        with self._tables_lock:
            if self._built is None:
                import xgrammar as xgr

                # The model's vocab (lm_head rows) may exceed the tokenizer's: xgrammar masks the extra ids.
                info = tokenizer_info(self.tokenizer, self.vocab_size, self.eos_token_ids)
                guard = SurrogateGuard(info.decoded_vocab, self.vocab_size)
                banned = sorted(set(_special_token_ids(self.tokenizer, self.vocab_size, self.eos_token_ids))
                                | set(guard.banned_token_ids))
                keep_mask = bitmask_ops.keep_mask(self.vocab_size, banned) if banned else None
                threads = self._compile_threads or min(8, os.cpu_count() or 1)
                # Our CompileCache does the caching: xgrammar's own cache would hold every grammar twice.
                compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
                self._built = _Tables(info, guard, keep_mask, compiler)
            return self._built

    def _json_whitespace(self) -> Optional[str]:
        """The rules JSON grammars use for whitespace (None: xgrammar's own), built once; no vocabulary scan, so
        `validate` stays a parse."""
        if self._whitespace_rules is None and self._any_whitespace and self._max_whitespace_cnt is None:
            self._whitespace_rules = whitespace_rules(self._whitespace_pattern or DEFAULT_JSON_WHITESPACE)
        return self._whitespace_rules

    def _parse(self, kind: str, text: str) -> None:
        import xgrammar as xgr

        if kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "json_schema":
            self._json_schema_grammar(text)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(text)
        # json_object has nothing to check

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        compiler = self._tables().compiler
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "json_schema":
            return compiler.compile_grammar(self._json_schema_grammar(text))
        if kind == "json_object":
            return compiler.compile_grammar(self._json_schema_grammar(_ANY_OBJECT_SCHEMA, strict=False))
        return compiler.compile_grammar(text)

    def _new_grammar(self, compiled: xgr.CompiledGrammar) -> XGrammarGrammar:
        tables = self._tables()
        return XGrammarGrammar(compiled, self.eos_token_ids, tables.keep_mask, tables.guard)

    def _json_schema_grammar(self, schema: str, strict: bool = True) -> xgr.Grammar:
        import xgrammar as xgr

        grammar = xgr.Grammar.from_json_schema(schema, **self._json_options(), strict_mode=strict)
        ebnf = str(grammar)
        rewritten = ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)
        rules = self._json_whitespace()
        if rules is not None:
            rewritten = rewritten.replace(_XGRAMMAR_ANY_WHITESPACE, _WS_RULE_PREFIX + "root")
            rewritten += "\n" + rules
        if rewritten == ebnf:
            return grammar
        try:
            return xgr.Grammar.from_ebnf(rewritten)
        except RuntimeError:
            logger.warning("could not rewrite the string/whitespace rules of a JSON schema grammar; using it as is")
            return grammar

    def _json_options(self) -> dict[str, Any]:
        return {"any_whitespace": self._any_whitespace, "max_whitespace_cnt": self._max_whitespace_cnt}

    @staticmethod
    def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                      rows: Optional[torch.Tensor] = None) -> None:
        """In place: disallowed tokens -> -inf in `rows` of `logits` (all rows when None); others untouched."""
        if rows is not None and rows.numel() == 0:
            return
        if not (logits.device.type == "cpu" or (logits.device.type == "cuda" and _HAS_TRITON)):
            bitmask_ops.apply_bitmask_torch(logits, bitmask, rows)
            return
        import xgrammar as xgr

        bitmask = bitmask.to(logits.device)
        indices = None if rows is None else [int(r) for r in rows.tolist()]
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=indices)


def whitespace_rules(pattern: str) -> str:
    """EBNF rules for `pattern` whose start rule is `json_ws_root` (to stand for JSON's whitespace runs)."""
    import xgrammar as xgr

    rules = str(xgr.Grammar.from_regex(pattern))
    for name in sorted(set(re.findall(r"^(\w+) ::=", rules, re.M)), key=len, reverse=True):
        rules = re.sub(rf"\b{name}\b", _WS_RULE_PREFIX + name, rules)
    return rules


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's tables of the vocabulary (`vocab_size`: the model's, padding ids masked).

    xgrammar reads transformers' fast tokenizers only. For a LightTokenizer it gets transformers' generic
    TokenizersBackend of the same folder, the class the LightTokenizer stands for (the scheduler uses one only
    where AutoTokenizer builds that class: model/tokenizer_check.py); loaded without AutoTokenizer's model-config
    imports and dropped once the tables are built.
    """
    import xgrammar as xgr

    if isinstance(tokenizer, LightTokenizer):
        from transformers import TokenizersBackend

        tokenizer = TokenizersBackend.from_pretrained(tokenizer.name_or_path, local_files_only=True)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)


def _special_token_ids(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> list[int]:
    """Special tokens other than eos: xgrammar would match their text ("<|im_start|>") as output, but
    detokenization skips them, so the text the client gets would not be the text that matched."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(token_id)
    return sorted(i for i in ids if 0 <= i < vocab_size and i not in eos_token_ids)


def _bit_set(row: torch.Tensor, token_id: int) -> bool:
    word, bit = divmod(token_id, bitmask_ops.BITS_PER_WORD)
    return word < row.shape[0] and bool((int(row[word]) >> bit) & 1)
