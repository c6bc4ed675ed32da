"""Test helpers shared by the model and kernel tests: a kvstrata model and its transformers twin on one tiny
checkpoint (Pair), prompts, and how far two results may differ (TOLERANCE, relative_error).

Pairs are cached per (case, dtype) and dropped at the end of each test module (tests/model/conftest.py).
"""

from __future__ import annotations

import torch
import transformers

from kvstrata.model.config import ModelConfig
from kvstrata.model.loader import load_model
from tests.device import TEST_DEVICE
from tests.model.forward_batch import PagedSequences, make_pool

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
PROMPT_LENS = [5, 19, 1, 12]  # a one-token prompt takes the decode path at prefix 0; 37 rows > UPCAST_MIN_ROWS


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max|ours - ref| / max|ref|."""
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def random_prompts(lens: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Token ids avoiding bos/eos (ids 1..3) so no prompt ends early."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in lens]


class Pair:
    """A kvstrata model and the transformers model loaded from the same folder, in one dtype."""

    _cache: dict[tuple[str, torch.dtype], Pair] = {}

    def __init__(self, path: str, dtype: torch.dtype):
        self.config = ModelConfig.from_path(path)
        self.ours = load_model(path, self.config, dtype, TEST_DEVICE)
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(TEST_DEVICE).eval()
        self.dtype = dtype

    @classmethod
    def get(cls, checkpoint_dir, case: str, dtype: torch.dtype) -> Pair:
        """Loaded once per (case, dtype) for the whole test module."""
        if (case, dtype) not in cls._cache:
            cls._cache[(case, dtype)] = Pair(checkpoint_dir(case), dtype)
        return cls._cache[(case, dtype)]

    @torch.inference_mode()
    def hf_logits(self, tokens: list[int]) -> torch.Tensor:
        """transformers' logits `[len, vocab]` for one sequence run alone."""
        return self.hf(torch.tensor([tokens], device=TEST_DEVICE)).logits[0].float()

    def sequences(self, page_size: int = 4, scatter: bool = False, shuffle: bool = True) -> PagedSequences:
        """A fresh pool (shuffled pages unless told otherwise) for this model."""
        pool = make_pool(self.config, num_pages=256 // page_size, page_size=page_size, dtype=self.dtype)
        return PagedSequences(pool, seed=1, scatter=scatter, shuffle=shuffle)

    def prefill_logits(self, prompts: list[list[int]]) -> torch.Tensor:
        """Our logits for `prompts` prefilled together in a fresh pool."""
        seqs = self.sequences()
        ids, positions, meta = seqs.batch(list(enumerate(prompts)))
        return self.ours(ids, positions, meta, seqs.pool)

    @classmethod
    def drop_all(cls) -> None:
        """Forget every loaded pair (the end of a test module)."""
        cls._cache.clear()
