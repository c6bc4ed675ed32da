"""`kvstrata bench make-dataset`: a ShareGPT-format JSON file made from a local text corpus (no download).

SGLang's benchmarks read ShareGPT_V3_unfiltered_cleaned_split.json: a list of conversations, each
`{"id": ..., "conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}`. This
writes the same structure from the sentences of a text file (default: the corpus the built-in tokenizers
are trained on), so that `--dataset-path` runs prompts made of text without the real dataset:

    kvstrata bench make-dataset --out sharegpt.json --num-conversations 1000
    kvstrata bench compare --preset seed --dataset-path sharegpt.json   # without --disable-random-sample

Each conversation alternates human and gpt turns, each turn a run of consecutive sentences starting at a
random place in the corpus (seeded: the same flags write the same file).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
from typing import Optional

DEFAULT_CORPUS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "model", "corpus.txt")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def corpus_sentences(text: str) -> list[str]:
    """The corpus's sentences, whitespace-normalised, in order."""
    flat = " ".join(text.split())
    return [s for s in _SENTENCE_END.split(flat) if s]


def make_conversations(sentences: list[str], count: int, turns: int, max_sentences: int,
                       rng: random.Random) -> list[dict]:
    """`count` ShareGPT conversations of `turns` turns (human first), each turn 1..max_sentences sentences."""
    if not sentences:
        raise ValueError("the corpus has no sentences")
    if count < 1 or turns < 2 or max_sentences < 1:
        raise ValueError("need at least 1 conversation, 2 turns and 1 sentence per turn")
    out = []
    for i in range(count):
        pos = rng.randrange(len(sentences))
        conv = []
        for t in range(turns):
            n = rng.randint(1, max_sentences)
            span = [sentences[(pos + k) % len(sentences)] for k in range(n)]
            pos += n
            conv.append({"from": "human" if t % 2 == 0 else "gpt", "value": " ".join(span)})
        out.append({"id": f"kvstrata-{i}", "conversations": conv})
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    p = argparse.ArgumentParser(prog="kvstrata bench make-dataset", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="The JSON file to write.")
    p.add_argument("--corpus", default=DEFAULT_CORPUS, help="UTF-8 text file to take sentences from.")
    p.add_argument("--num-conversations", type=int, default=1000)
    p.add_argument("--turns", type=int, default=2, help="Turns per conversation (human, gpt, human, ...).")
    p.add_argument("--max-sentences", type=int, default=12, help="Most sentences in one turn.")
    p.add_argument("--seed", type=int, default=1)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry point."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        with open(args.corpus, encoding="utf-8") as fh:
            sentences = corpus_sentences(fh.read())
        convs = make_conversations(sentences, args.num_conversations, args.turns, args.max_sentences,
                                   random.Random(args.seed))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(convs, fh, ensure_ascii=False)
    print(f"wrote {len(convs)} conversations ({len(sentences)} corpus sentences) to {args.out}")
    return 0
