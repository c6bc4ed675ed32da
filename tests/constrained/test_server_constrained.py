"""Structured output end to end: regex, JSON-schema and EBNF constraints through real kvstrata servers.

Two servers with the random-weight tiny model (the worst case: the model knows nothing), started
together once for the module:
  - `main`: the default JSON whitespace (any whitespace, what users get) and a 64-token prefill chunk,
    so that any prompt over 64 tokens is prefilled in chunks;
  - `compact`: `--constrained-json-disable-any-whitespace` and the default chunk size. Regexes do not
    depend on the whitespace flag, so the two servers must agree on a greedy regex-constrained output
    of a long prompt that only `main` chunks.
Every output that finishes with reason `stop` (the grammar ended, eos) must satisfy its constraint;
outputs cut by max_new_tokens must still be a prefix of a regex match.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import jsonschema
import openai
import pytest

from tests.constrained.constraint_suite import EBNF, REGEXES, Constraint, all_constraints
from tests.server.conftest import ServerHandle, launch_server, stop_server
from tests.server.helpers import sse_events

MAX_NEW_TOKENS = 128
SAMPLED_VARIANTS = 3            # per constraint, besides one greedy run
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
PERSON_TEXT = json.dumps(PERSON)
PERSON_CONSTRAINT = Constraint("json_schema", "person", PERSON_TEXT)
POOL_FLAGS = ("--max-total-tokens", "32768")     # the whole suite decodes as one batch of ~180 requests


@dataclass
class Servers:
    main: ServerHandle
    compact: ServerHandle


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """Both servers, launched in parallel; stopped by PID at the end, even if a test or a launch fails."""
    log_dir = tmp_path_factory.mktemp("constrained-servers")
    flags = {"main": (*POOL_FLAGS, "--chunked-prefill-size", "64"),
             "compact": (*POOL_FLAGS, "--constrained-json-disable-any-whitespace")}
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(launch_server, log_dir, *f) for name, f in flags.items()}
    handles, errors = {}, []
    for name, future in futures.items():
        try:
            handles[name] = future.result()
        except Exception as e:     # launch_server stops its own process when it fails
            errors.append(e)
    try:
        if errors:
            raise errors[0]
        yield Servers(**handles)
    finally:
        for handle in handles.values():
            stop_server(handle)


def generate(server: ServerHandle, **body: Any) -> Any:
    r = server.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def finish(out: dict) -> dict:
    return out["meta_info"]["finish_reason"]


@dataclass
class Run:
    """One request of the suite batch and its output."""

    constraint: Optional[Constraint]
    prompt: str
    params: dict
    out: dict

    @property
    def stopped(self) -> bool:
        return finish(self.out)["type"] == "stop"


def suite_requests(constraints: list[Constraint]) -> list[tuple[Optional[Constraint], str, dict]]:
    """Per constraint one greedy and SAMPLED_VARIANTS sampled requests, plus unconstrained ones in between."""
    requests_ = []
    for i, c in enumerate(constraints):
        for v in range(1 + SAMPLED_VARIANTS):
            params = {**c.sampling_field(), "max_new_tokens": MAX_NEW_TOKENS, "temperature": 0 if v == 0 else 1,
                      "sampling_seed": 1000 * i + v}
            requests_.append((c, f"Record {i}.{v}:", params))
        if i % 4 == 0:
            requests_.append((None, f"Story {i}:", {"max_new_tokens": 48, "temperature": (i // 4) % 2}))
    return requests_


def run_batch(server: ServerHandle, requests_: list[tuple[Optional[Constraint], str, dict]]) -> list[Run]:
    """All requests in one /generate list call, so that they decode together."""
    outs = generate(server, text=[p for _, p, _ in requests_], sampling_params=[s for _, _, s in requests_])
    return [Run(c, p, s, o) for (c, p, s), o in zip(requests_, outs)]


@pytest.fixture(scope="module")
def main_runs(servers) -> list[Run]:
    return run_batch(servers.main, suite_requests(all_constraints()))


@pytest.fixture(scope="module")
def compact_runs(servers) -> list[Run]:
    return run_batch(servers.compact, suite_requests([c for c in all_constraints() if c.kind == "json_schema"]))


def check_runs(runs: list[Run], kind: str, min_constraints: int) -> float:
    """Check every `kind` output; returns the fraction that finished with stop."""
    mine = [r for r in runs if r.constraint is not None and r.constraint.kind == kind]
    for r in mine:
        r.constraint.check_output(r.out["text"], finish(r.out)["type"])
    names_with_stop = {r.constraint.name for r in mine if r.stopped}
    fraction = sum(r.stopped for r in mine) / len(mine)
    print(f"{kind}: {sum(r.stopped for r in mine)}/{len(mine)} outputs ({fraction:.0%}) finished with stop, "
          f"{len(names_with_stop)}/{len({r.constraint.name for r in mine})} constraints had one")
    assert len(names_with_stop) >= min_constraints, f"too few constraints ever finished: {names_with_stop}"
    assert fraction >= 0.6
    return fraction


@pytest.mark.parametrize("kind, min_constraints", [("json_schema", 20), ("regex", 10), ("ebnf", 3)])
def test_stopped_outputs_satisfy_their_constraint(main_runs, kind, min_constraints):
    check_runs(main_runs, kind, min_constraints)
    unconstrained = [r for r in main_runs if r.constraint is None]
    assert unconstrained and all(r.out["meta_info"]["completion_tokens"] > 0 for r in unconstrained)


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _between_tokens(text: str) -> str:
    """The JSON text without its string literals: what the whitespace flag governs."""
    return _JSON_STRING.sub('""', text)


def test_compact_whitespace_mode(main_runs, compact_runs):
    check_runs(compact_runs, "json_schema", 20)
    compact = [_between_tokens(r.out["text"]) for r in compact_runs if r.constraint is not None and r.stopped]
    for text in compact:    # xgrammar's compact separators are ", " and ": "; nothing else
        assert not re.search(r"[\n\r\t]|  |^ | $|[^,:] ", text), text
    default = [_between_tokens(r.out["text"]) for r in main_runs
               if r.constraint is not None and r.constraint.kind == "json_schema" and r.stopped]
    assert sum(bool(re.search(r"[\n\r\t]", t)) for t in default) >= len(default) // 4


def test_mixed_batch_gives_each_greedy_request_its_result_alone(servers, main_runs):
    picks = [r for r in main_runs if r.params["temperature"] == 0 and (
        r.constraint is None or r.constraint.name in ("flat_object", "phone", "arithmetic", "seed_braces"))]
    assert sum(r.constraint is None for r in picks) >= 2 and len(picks) >= 6
    for r in picks:
        alone = generate(servers.main, text=r.prompt, sampling_params=r.params)
        assert alone["output_ids"] == r.out["output_ids"], (r.prompt, r.params)


def test_n_copies_each_follow_the_grammar(servers):
    outs = generate(servers.main, text=["Person:", "Date:"],
                    sampling_params=[{"json_schema": PERSON_TEXT, "n": 4, "temperature": 1, "max_new_tokens": 96},
                                     {"regex": REGEXES["iso_date"], "n": 3, "temperature": 1, "sampling_seed": 5}])
    assert len(outs) == 7
    person, dates = outs[:4], outs[4:]
    for o in person:
        PERSON_CONSTRAINT.check_output(o["text"], finish(o)["type"])
    assert all(finish(o)["type"] == "stop" and re.fullmatch(REGEXES["iso_date"], o["text"]) for o in dates)
    assert len({o["text"] for o in dates}) > 1      # copies sample independently
    greedy = generate(servers.main, text="Person:", sampling_params={"json_schema": PERSON_TEXT, "n": 3,
                                                                      "temperature": 0})
    assert len({o["text"] for o in greedy}) == 1


def test_streamed_text_is_cumulative_and_its_final_text_validates(servers):
    r = servers.main.post("/generate", stream=True, json={
        "text": ["Person:", "Phone:"], "stream": True,
        "sampling_params": [{"json_schema": PERSON_TEXT, "temperature": 1, "sampling_seed": 3, "max_new_tokens": 96},
                            {"regex": REGEXES["phone"], "temperature": 1, "sampling_seed": 4}]})
    assert r.status_code == 200
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    final = {}
    for e in events[:-1]:
        i = e["index"]
        assert e["text"].startswith(final.get(i, {"text": ""})["text"])
        final[i] = e
    assert finish(final[1])["type"] == "stop" and re.fullmatch(REGEXES["phone"], final[1]["text"])
    PERSON_CONSTRAINT.check_output(final[0]["text"], finish(final[0])["type"])
    same = generate(servers.main, text="Person:", sampling_params={
        "json_schema": PERSON_TEXT, "temperature": 1, "sampling_seed": 3, "max_new_tokens": 96})
    assert same["text"] == final[0]["text"]


def test_stop_strings_cut_constrained_output(servers):
    base = {"json_schema": PERSON_TEXT, "temperature": 0, "stop": ['"age"']}
    trimmed, kept = generate(servers.main, text=["Person:"] * 2,
                             sampling_params=[base, {**base, "no_stop_trim": True}])
    assert finish(trimmed)["matched"] == '"age"' and finish(kept)["matched"] == '"age"'
    assert trimmed["text"].startswith("{") and trimmed["text"].rstrip().endswith(",")
    # no_stop_trim keeps the stop string and the rest of the token that completed it
    assert kept["text"].startswith(trimmed["text"] + '"age"')
    # A stop string that never comes does not keep the grammar from ending the request.
    out = generate(servers.main, text="Answer:", sampling_params={"regex": REGEXES["yes_no"], "stop": ["zzz"]})
    assert finish(out)["type"] == "stop" and re.fullmatch(REGEXES["yes_no"], out["text"])


def test_long_prompt_prefilled_in_chunks(servers):
    prompt = "Context: " + " ".join(f"item{i} is {i * 7 % 13}" for i in range(60)) + ". Answer:"
    params = [{"regex": REGEXES["url"], "temperature": 0},
              {"json_schema": PERSON_TEXT, "temperature": 1, "sampling_seed": 9, "max_new_tokens": 96},
              {"ebnf": EBNF["word_list"][0], "temperature": 1, "sampling_seed": 10}]
    chunked = generate(servers.main, text=[prompt] * 3, sampling_params=params)
    assert chunked[0]["meta_info"]["prompt_tokens"] > 3 * 64
    whole = generate(servers.compact, text=prompt, sampling_params=params[0])
    assert chunked[0]["output_ids"] == whole["output_ids"]
    assert finish(chunked[0])["type"] == "stop" and re.fullmatch(REGEXES["url"], chunked[0]["text"])
    PERSON_CONSTRAINT.check_output(chunked[1]["text"], finish(chunked[1])["type"])
    assert finish(chunked[2])["type"] == "stop" and EBNF["word_list"][1](chunked[2]["text"])


INVALID = {
    "regex-unclosed": ({"regex": "(abc"}, "parenthesis is not closed"),
    "regex-class": ({"regex": "[a-"}, "Unclosed '['"),
    "regex-unsupported": ({"regex": r"\p{L}"}, "not supported"),
    "schema-not-json": ({"json_schema": "{bad"}, "Failed to parse JSON"),
    "schema-bad-type": ({"json_schema": {"type": "strng"}}, 'Unsupported type "strng"'),
    "schema-bad-range": ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum greater"),
    "schema-bad-ref": ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}}, "$defs"),
    "schema-bad-pattern": ({"json_schema": {"type": "string", "pattern": "(a"}}, "parenthesis is not closed"),
    "ebnf-undefined": ({"ebnf": "root ::= foo"}, 'Rule "foo" is not defined'),
    "ebnf-no-root": ({"ebnf": 'rot ::= "a"'}, 'root rule with name "root" is not found'),
    "ebnf-literal": ({"ebnf": 'root ::= "a'}, "string literal"),
    "two-constraints": ({"regex": "a+", "json_schema": {"type": "string"}}, "only one of"),
    "three-constraints": ({"regex": "a+", "ebnf": 'root ::= "a"', "json_schema": "{}"}, "only one of"),
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_constraint_gets_400_with_the_compiler_message(servers, name):
    constraint, phrase = INVALID[name]
    r = servers.main.post("/generate", json={"text": "x", "sampling_params": {**constraint, "max_new_tokens": 4}})
    assert r.status_code == 400, r.text
    assert phrase in r.json()["error"]["message"]
    ok = generate(servers.main, text="x", sampling_params={"regex": "(yes|no)"})
    assert finish(ok)["type"] == "stop" and ok["text"] in ("yes", "no")


def test_invalid_constraint_in_a_batch_and_stream_fails_cleanly(servers):
    server = servers.main
    before = server.wait_idle()
    bad = {"text": ["a", "b"], "sampling_params": [{"regex": "[0-9]{2}"}, {"ebnf": "root ::= foo"}]}
    r = server.post("/generate", json=bad)
    assert r.status_code == 400 and "foo" in r.json()["error"]["message"]
    # Streamed, the error is a 400 if it comes before any output, else an error event in the stream.
    r = server.post("/generate", json={**bad, "stream": True})
    if r.status_code == 200:
        errors = [e for e in sse_events(r) if isinstance(e, dict) and "error" in e]
        assert errors and "foo" in errors[0]["error"]["message"]
    else:
        assert r.status_code == 400 and "foo" in r.json()["error"]["message"]
    r = server.post("/generate", json={"text": "c", "stream": True, "sampling_params": {"regex": "(a"}})
    assert r.status_code == 400 and "parenthesis" in r.json()["error"]["message"]
    after = server.wait_idle()
    # Nothing leaked: pages are free or held by the prefix tree (a request may have been prefilled).
    assert after["integrity_ok"]
    assert after["free_pages"] + after["cache_pages"] == before["free_pages"] + before["cache_pages"]
    assert generate(server, text="a", sampling_params={"regex": "[0-9]{2}"})["text"].isdigit()


# ---------------------------------------------------------------------- OpenAI API (official client)
@pytest.fixture(scope="module")
def client(servers) -> openai.OpenAI:
    return openai.OpenAI(base_url=servers.main.url + "/v1", api_key="unused", max_retries=0, timeout=120)


USER = [{"role": "user", "content": "Describe a person as JSON."}]


def test_openai_json_object_and_strict_json_schema(client):
    with ThreadPoolExecutor(2) as pool:   # both decode at the same time
        objects = pool.submit(client.chat.completions.create, model="tiny", messages=USER, n=4, seed=21,
                              temperature=1, max_tokens=96, response_format={"type": "json_object"})
        people = pool.submit(client.chat.completions.create, model="tiny", messages=USER, n=4, seed=22,
                             temperature=1, max_tokens=96, response_format={
                                 "type": "json_schema", "json_schema": {"name": "person", "strict": True,
                                                                        "schema": PERSON}})
        objects, people = objects.result(), people.result()
    stopped = 0
    for choice in objects.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
            stopped += 1
    for choice in people.choices:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), PERSON)
            stopped += 1
    assert stopped >= 2


def test_openai_completions_streaming_and_extras(client):
    # The client's completions.create has no response_format parameter; the server takes it anyway.
    done = client.completions.create(model="tiny", prompt="Person:", max_tokens=96, temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    PERSON_CONSTRAINT.check_output(done.choices[0].text, done.choices[0].finish_reason)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=96, temperature=1, seed=3, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(reasons) == 1
    PERSON_CONSTRAINT.check_output(text, reasons[0])
    color = client.chat.completions.create(model="tiny", messages=USER, max_tokens=16,
                                           extra_body={"regex": REGEXES["hex_color"]})
    assert re.fullmatch(REGEXES["hex_color"], color.choices[0].message.content)
    grammar, _ = EBNF["arithmetic"]
    expr = client.completions.create(model="tiny", prompt="2+2=", max_tokens=64, temperature=0,
                                     extra_body={"ebnf": grammar})
    Constraint("ebnf", "arithmetic", grammar).check_output(expr.choices[0].text, expr.choices[0].finish_reason)


@pytest.mark.parametrize("kw, phrase", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
     "Unsupported type"),
    ({"extra_body": {"regex": "(unclosed"}}, "parenthesis is not closed"),
    ({"extra_body": {"ebnf": "root ::= foo"}}, "not defined"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"regex": "a+"}}, "cannot be combined"),
    ({"response_format": {"type": "xml"}}, "not supported"),
])
def test_openai_invalid_constraints_are_bad_requests(client, kw, phrase):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=4, **kw)
    assert phrase in str(info.value)
