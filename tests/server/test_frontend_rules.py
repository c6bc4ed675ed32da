"""The frontend's length and vocabulary rules on their own (no model): what both HTTP and Engine apply."""

from __future__ import annotations

import pytest

from kvstrata.runtime.sampling_params import SamplingParams
from kvstrata.serving.errors import ApiError
from kvstrata.serving.frontend import RequestLimits, prepare_prompt
from kvstrata.serving.protocol import PromptSpec

LIMITS = RequestLimits(context_length=64, max_total_tokens=50, vocab_size=100, max_prompt_chars=640)


def prompt(n: int, explicit: bool = False, **sampling) -> PromptSpec:
    return PromptSpec(text=None, input_ids=[1] * n, sampling=SamplingParams(**sampling), rid="r",
                      max_new_tokens_explicit=explicit)


def test_defaulted_max_new_tokens_is_cut_to_the_room_of_context_and_pool():
    assert prepare_prompt(prompt(40), LIMITS)[1].max_new_tokens == 10          # the pool (50) is smaller
    fitted = prepare_prompt(prompt(48, min_new_tokens=5), LIMITS)[1]
    assert (fitted.max_new_tokens, fitted.min_new_tokens) == (2, 2)
    assert prepare_prompt(prompt(10, max_new_tokens=4), LIMITS)[1].max_new_tokens == 4   # fits: unchanged


@pytest.mark.parametrize("spec, message", [
    (prompt(60, explicit=True, max_new_tokens=10), "exceeds the model's context length"),
    (prompt(40, explicit=True, max_new_tokens=20), "KV cache"),
    (prompt(55), "KV cache"),                                   # fitted to 0 new tokens, still too big
    (prompt(64), "longer than the model's context length"),
    (prompt(65, max_new_tokens=0), "longer than the model's context length"),
    (prompt(0), "empty"),
    (prompt(3, stop_token_ids=[100]), "stop_token_ids"),
    (prompt(3, logit_bias={100: 1.0}), "logit_bias"),
])
def test_refused(spec, message):
    with pytest.raises(ApiError, match=message) as e:
        prepare_prompt(spec, LIMITS)
    assert e.value.status == 400


def test_edge_cases_that_are_served():
    roomy = RequestLimits(context_length=64, max_total_tokens=4096, vocab_size=100, max_prompt_chars=640)
    assert prepare_prompt(prompt(64, explicit=True, max_new_tokens=0), roomy)[1].max_new_tokens == 0  # scoring
    assert prepare_prompt(prompt(3, top_k=100), LIMITS)[1].top_k == -1      # top_k >= vocab keeps every token
    spec = prompt(3, top_k=100)
    prepare_prompt(spec, LIMITS)
    assert spec.sampling.top_k == 100, "the client's params are not changed in place"
