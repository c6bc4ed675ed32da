"""The offline engines and prompts the engine benchmarks measure with (bench engine, --profile, --load-back)."""

from __future__ import annotations

import random


def make_engine(args, deterministic: bool = False, radix_cache: bool = False, **overrides):
    """The offline engine every kvstrata measurement here uses; without `radix_cache` every prompt is computed.
    `overrides`: further ServerArgs fields."""
    import kvstrata

    options = dict(model_path=args.model_path, load_format=args.load_format, dtype=args.dtype, device=args.device,
                   disable_radix_cache=not radix_cache,
                   # room for the 1-stream and the S-stream prompts cached side by side
                   max_total_tokens=(args.streams + 1) * (args.context + args.decode_tokens) + 1024,
                   num_threads=args.threads, random_seed=0, chunked_prefill_size=args.context,
                   page_size=args.page_size, enable_deterministic_inference=deterministic,
                   # the host tier backs up every cached prompt while the streams decode
                   enable_hierarchical_cache=radix_cache and args.enable_hierarchical_cache,
                   hicache_ratio=2.0)
    return kvstrata.Engine(**{**options, **overrides})


def prompt_maker(vocab: int, seed: int = 0):
    """A function n -> n random non-special token ids (reproducible from `seed`)."""
    rng = random.Random(seed)
    return lambda n: [rng.randrange(100, vocab - 1) for _ in range(n)]
