"""The same programs give the same greedy results over HTTP and in process.

Each comparison starts from empty prefix caches on both sides, so that both runtimes compute the same
extends: float results (and thus a near-tie greedy pick) may depend on where a cached prefix ends.
"""

from __future__ import annotations

import kvstrata.lang as sgl
from tests.lang.programs import (
    branches,
    constrained,
    few_shot_qa,
    generate_json,
    multi_turn_chat,
    pick_city,
    support_ticket,
)

GREEDY = {"temperature": 0}

RUNS = [
    (multi_turn_chat, ("Hello there", "Tell me more"), {}),
    (few_shot_qa, ("Where do pages live?",), {}),
    (pick_city, (), {}),
    (branches, (3,), {}),
    (constrained, (), {}),
    (generate_json, (), {}),
]


def _outcome(state) -> tuple:
    return state.text(), state.messages(), state.variables()


def test_programs_agree_across_backends(http_backend, engine_backend):
    for program, args, kwargs in RUNS:
        sgl.flush_cache(http_backend)
        sgl.flush_cache(engine_backend)
        over_http = program.run(*args, backend=http_backend, **GREEDY, **kwargs)
        in_process = program.run(*args, backend=engine_backend, **GREEDY, **kwargs)
        assert _outcome(over_http) == _outcome(in_process), program.__name__


def test_run_batch_agrees_across_backends(http_backend, engine_backend):
    batch = [{"question": f"Is page {i} on the device?"} for i in range(6)]
    sgl.flush_cache(http_backend)
    sgl.flush_cache(engine_backend)
    over_http = support_ticket.run_batch(batch, backend=http_backend, **GREEDY)
    in_process = support_ticket.run_batch(batch, backend=engine_backend, num_threads=3, **GREEDY)
    assert [s.text() for s in over_http] == [s.text() for s in in_process]
