"""Per-step cost of grammar masks: fill the bitmask of a batch, then apply it to the logits.

Usage: kvstrata bench grammar-steps [--batch-size 8] [--vocab-size 32000] [--steps 200]

Trains a byte-level BPE tokenizer of the requested size on the Python standard library's sources
(no download), compiles a JSON schema, a regex and an EBNF grammar, and decodes `--steps` steps of a
batch in which every request is constrained, sampling random allowed tokens. Reports compile time
(new and cached) and the mean/P50/P99 time per step of fill (all rows) and apply.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sysconfig
import time

import torch

from kvstrata.constrained import create_grammar_backend

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                   "pattern": "[0-9]{5}"}},
                "required": ["city"]}},
    "required": ["name", "age"]}
CONSTRAINTS = [("json_schema", json.dumps(SCHEMA)), ("regex", r"\{.*\}"),
               ("ebnf", 'root ::= "(" [a-z]+ ("," [a-z]+)* ")"')]


def train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on the standard library's .py files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sources = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in sources]
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|im_end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    model.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=model, eos_token="<|im_end|>")


def _ms(seconds: list[float]) -> str:
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return (f"mean {1e3 * statistics.mean(ordered):.3f} ms, p50 {1e3 * statistics.median(ordered):.3f} ms, "
            f"p99 {1e3 * p99:.3f} ms")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a small report."""
    parser = argparse.ArgumentParser(prog="kvstrata bench grammar-steps", description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    tokenizer = train_tokenizer(args.vocab_size)
    print(f"tokenizer: {len(tokenizer)} tokens, trained in {time.perf_counter() - start:.1f} s")
    backend = create_grammar_backend("xgrammar", tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    try:
        for kind, text in CONSTRAINTS:
            start = time.perf_counter()
            backend.compile(kind, text)
            new = time.perf_counter() - start
            start = time.perf_counter()
            backend.compile(kind, text)
            print(f"compile {kind}: new {1e3 * new:.1f} ms, cached {1e3 * (time.perf_counter() - start):.3f} ms")
        _decode(backend, args)
    finally:
        backend.close()
    return 0


def _decode(backend, args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(0)
    bitmask = backend.allocate_bitmask(args.batch_size)
    rows = torch.arange(args.batch_size, device=device)
    grammars = [backend.compile(*CONSTRAINTS[i % len(CONSTRAINTS)]) for i in range(args.batch_size)]
    fill_s, apply_s = [], []
    for _ in range(args.steps):
        logits = torch.randn(args.batch_size, backend.vocab_size, device=device, generator=generator)
        start = time.perf_counter()
        for row, grammar in enumerate(grammars):
            grammar.fill_bitmask(bitmask, row)
        fill_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        backend.apply_bitmask(logits, bitmask, rows)
        if device.type == "cuda":
            torch.cuda.synchronize()
        apply_s.append(time.perf_counter() - start)
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).flatten().tolist()
        for row, token in enumerate(tokens):
            grammar = grammars[row]
            if grammar.is_terminated() or not grammar.accept_token(token) or grammar.is_terminated():
                grammars[row] = grammar.copy()  # restart finished requests so the batch stays full
    print(f"batch {args.batch_size}, vocab {backend.vocab_size}, {args.steps} steps on {device}:")
    print(f"  fill  (all rows): {_ms(fill_s)}")
    print(f"  apply (all rows): {_ms(apply_s)}")


if __name__ == "__main__":
    main()
