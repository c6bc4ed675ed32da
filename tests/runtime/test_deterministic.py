"""--enable-deterministic-inference: a request's output does not depend on what else is in the batch.

One greedy request (with logprobs) is run alone, then inside batches of 1, 7 and 31 other requests of
different lengths: some share its prefix (so its prompt is partly a cache hit), long ones are chunked
(so prefill and decode mix in one step), and the batch order is shuffled. Its output ids, logprobs and top
logprobs must be bit-identical every time, in bfloat16 and in float32, whatever the CPU.
"""

from __future__ import annotations

import random

import pytest

from tests.runtime.determinism import check_alone_equals_in_batches
from tests.runtime.helpers import make_engine


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_request_alone_equals_it_in_any_batch(dtype, page_size):
    engine = make_engine(dtype=dtype, enable_deterministic_inference=True, chunked_prefill_size=64,
                         max_total_tokens=16384, page_size=page_size)
    try:
        check_alone_equals_in_batches(engine, random.Random(1234 + page_size), dtype)
    finally:
        engine.shutdown()
