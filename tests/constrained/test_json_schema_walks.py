"""Random-model decoding under JSON schemas: every output that ends validates against its schema."""

from __future__ import annotations

import json
import zlib

import jsonschema
import pytest

from tests.constrained.random_walk import run_walks
from tests.constrained.schemas import FORMAT_CHECKER, SCHEMAS

WALKS_PER_SCHEMA = 6

@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_outputs_validate_against_schema(name, backend, tokenizer, bias):
    schema = SCHEMAS[name]
    walks = run_walks(backend, "json_schema", json.dumps(schema), tokenizer, bias, WALKS_PER_SCHEMA,
                      seed=zlib.crc32(name.encode()) % 1000)
    finished = [w for w in walks if w.terminated]
    assert len(finished) >= WALKS_PER_SCHEMA // 2, f"too few walks ended: {[w.text for w in walks]}"
    for walk in finished:
        value = json.loads(walk.text)
        jsonschema.validate(value, schema, format_checker=FORMAT_CHECKER)


def test_json_object_mode_gives_objects(backend, tokenizer, bias):
    walks = run_walks(backend, "json_object", "", tokenizer, bias, 8)
    finished = [w for w in walks if w.terminated]
    assert len(finished) >= 4
    for walk in finished:
        assert isinstance(json.loads(walk.text), dict), walk.text
