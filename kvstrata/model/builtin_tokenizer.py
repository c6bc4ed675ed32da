"""Deterministic byte-level BPE tokenizers of the built-in models, trained on text shipped in the package."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from importlib import resources

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers


@dataclass(frozen=True)
class TokenizerSpec:
    """What to train and which special tokens and chat template the folder declares."""

    vocab_size: int  # total, special tokens included
    special_tokens: tuple[str, ...]  # get the first ids, in this order
    eos_token: str  # the tokenizer's eos (ends an assistant turn)
    stop_tokens: tuple[str, ...]  # all eos ids of generation_config.json
    pad_token: str
    bos_token: str | None  # prepended to every encoding when set
    chat_template: str
    pseudo_text_chars: int = 0  # extra seeded pseudo-text, for vocabularies the corpus alone cannot fill
    corpus_repeats: int = 1  # weight of the real corpus against the pseudo-text
    seed: int = 0


def build_tokenizer(spec: TokenizerSpec, out_dir: str, model_max_length: int) -> dict[str, int]:
    """Train the tokenizer, write tokenizer.json, tokenizer_config.json, special_tokens_map.json.

    Returns the ids of the special tokens by name.
    """
    tok = _train(spec)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in spec.special_tokens}
    config = {
        # The generic fast class loads tokenizer.json as is (a model-specific class could re-derive it).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos_token,
        "eos_token": spec.eos_token,
        "pad_token": spec.pad_token,
        "unk_token": None,
        "add_bos_token": spec.bos_token is not None,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": spec.chat_template,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for t, i in ids.items()
        },
    }
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
    specials = {"eos_token": spec.eos_token, "pad_token": spec.pad_token}
    if spec.bos_token is not None:
        specials["bos_token"] = spec.bos_token
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), specials)
    return ids


def _train(spec: TokenizerSpec) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(spec.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_texts(spec), trainer)
    if spec.bos_token is not None:
        bos = (spec.bos_token, tok.token_to_id(spec.bos_token))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]}:1 $B:1", special_tokens=[bos])
    if tok.get_vocab_size() != spec.vocab_size:
        # Only reachable if the training text is changed to something much smaller: fail loudly, since
        # the config's vocab_size must match the tokenizer exactly.
        raise RuntimeError(f"BPE training reached {tok.get_vocab_size()} tokens, wanted {spec.vocab_size}")
    return tok


def training_texts(spec: TokenizerSpec) -> list[str]:
    """The corpus paragraphs (repeated `corpus_repeats` times), then the seeded pseudo-text."""
    corpus = read_corpus()
    paragraphs = [p for p in corpus.split("\n\n") if p.strip()]
    texts = paragraphs * spec.corpus_repeats
    if spec.pseudo_text_chars:
        texts += pseudo_text(spec.pseudo_text_chars, spec.seed)
    return texts


def read_corpus() -> str:
    """The English (plus a little multilingual, code and emoji) text shipped with the package."""
    return resources.files("kvstrata.model").joinpath("corpus.txt").read_text(encoding="utf-8")


_ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y",
           "z", "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gl", "gr", "pl", "pr", "sh", "sl", "sp",
           "st", "th", "tr", "wh")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "ai", "ea", "ee", "oo", "ou", "ie", "y")
_CODAS = ("", "", "", "", "n", "r", "s", "l", "m", "t", "d", "nd", "st", "ck", "ng", "rt")
_PUNCT = (".", ".", ".", ".", ",", "?", "!", ";", ":")


def pseudo_text(total_chars: int, seed: int, lexicon_size: int = 60000) -> list[str]:
    """Seeded paragraphs of invented syllabic words with a Zipf-like word frequency.

    Uses only `random.Random.random()` (Mersenne Twister, stable across Python versions) so the
    text, and therefore the trained vocabulary, is the same on every machine.
    """
    rng = random.Random(seed)

    def pick(options: tuple[str, ...]) -> str:
        return options[int(rng.random() * len(options))]

    def word() -> str:
        syllables = 1 + int(rng.random() * 3)
        return "".join(pick(_ONSETS) + pick(_VOWELS) + pick(_CODAS) for _ in range(syllables))

    lexicon = [word() for _ in range(lexicon_size)]
    paragraphs: list[str] = []
    size = 0
    while size < total_chars:
        sentences = []
        for _ in range(2 + int(rng.random() * 5)):
            # lexicon_size ** u for uniform u is log-uniform: word k is drawn with probability ~ 1/k.
            words = [lexicon[int(lexicon_size ** rng.random()) - 1] for _ in range(4 + int(rng.random() * 12))]
            if rng.random() < 0.1:
                words.insert(int(rng.random() * len(words)), str(int(rng.random() * 10000)))
            sentences.append(" ".join(words).capitalize() + pick(_PUNCT))
        paragraphs.append(" ".join(sentences))
        size += len(paragraphs[-1])
    return paragraphs


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(value, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
