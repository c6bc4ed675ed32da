"""Errors raise exceptions that name the problem, and never hang."""

from __future__ import annotations

import time

import pytest

import kvstrata.lang as sgl
from kvstrata.lang import assistant, assistant_begin, gen, select, user_begin, user_end
from kvstrata.net import free_port
from tests.lang.programs import support_ticket


@pytest.mark.parametrize("build, words", [
    (lambda: gen("x", max_tokens=-1), "max_new_tokens"),
    (lambda: gen("x", temperature="hot"), "temperature"),
    (lambda: gen("x", top_p=0), "top_p"),
    (lambda: gen("x", min_tokens=-3), "min_tokens"),
    (lambda: gen("x", dtype=complex), "dtype"),
    (lambda: gen("x", regex="a+", json_schema={"type": "string"}), "regex"),
    (lambda: gen("x", json_schema="{not json"), "json_schema"),
    (lambda: gen("x", stop=3.5), "stop"),
    (lambda: gen(42), "name"),
    (lambda: select("x", []), "choices"),
    (lambda: select("x", ["a", ""]), "choices"),
    (lambda: select("x", "ab"), "choices"),
    (lambda: select("x", ["a", "b"], temperature=-1), "temperature"),
    (lambda: select("x", ["a", "b"], choices_method="best"), "choices_method"),
])
def test_bad_arguments_raise_at_once(build, words):
    with pytest.raises((ValueError, TypeError), match=words):
        build()


def test_bad_run_arguments(engine_backend):
    with pytest.raises(ValueError, match="temperature"):
        support_ticket.run("q", temperature=-1, backend=engine_backend)
    with pytest.raises(TypeError, match="question"):
        support_ticket.run(backend=engine_backend)          # the program's own argument is missing
    with pytest.raises(ValueError, match="num_threads"):
        support_ticket.run_batch([{"question": "q"}], num_threads=0, backend=engine_backend)
    with pytest.raises(TypeError, match="list of dicts"):
        support_ticket.run_batch({"question": "q"}, backend=engine_backend)
    sgl.set_default_backend(None)
    with pytest.raises(ValueError, match="no backend"):
        support_ticket.run("q")


def test_server_rejection_names_the_problem(backend):
    too_long = sgl.function(lambda s: s.__iadd__("Hi" + gen("x", max_tokens=100_000)))
    with pytest.raises(sgl.ProgramError, match="context length"):
        too_long.run(backend=backend)
    # The backend keeps working after a rejected request.
    assert support_ticket.run("Still there?", backend=backend, temperature=0)["reply"] is not None


def test_invalid_regex_is_reported(backend):
    bad = sgl.function(lambda s: s.__iadd__("Hi" + gen("x", max_tokens=4, regex="(unclosed")))
    with pytest.raises(sgl.ProgramError, match="(?i)regex|regular expression|grammar"):
        bad.run(backend=backend)


def test_unreachable_server_fails_fast():
    start = time.monotonic()
    with pytest.raises(sgl.BackendError, match="cannot reach"):
        sgl.RuntimeEndpoint(f"http://127.0.0.1:{free_port()}")
    assert time.monotonic() - start < 15


def test_wrong_api_key_is_rejected(server_url):
    with pytest.raises(sgl.BackendError, match="401"):
        sgl.RuntimeEndpoint(server_url, api_key="wrong-key")


def test_role_mistakes(engine_backend):
    @sgl.function
    def unbalanced(s):
        s += user_begin() + "hi"
        s += assistant("nested")

    with pytest.raises(sgl.ProgramError, match="still open"):
        unbalanced.run(backend=engine_backend)

    @sgl.function
    def wrong_end(s):
        s += assistant_begin() + "hi" + user_end()

    with pytest.raises(sgl.ProgramError, match="cannot end a 'user' message"):
        wrong_end.run(backend=engine_backend)


def test_program_exceptions_propagate(engine_backend):
    @sgl.function
    def broken(s):
        s += "Hi" + gen("x", max_tokens=2)
        raise ZeroDivisionError("boom")

    with pytest.raises(ZeroDivisionError, match="boom"):
        broken.run(backend=engine_backend)
    state = broken.run(backend=engine_backend, stream=True)
    with pytest.raises(sgl.ProgramError, match="boom"):
        list(state.text_iter())


def test_unknown_variable(engine_backend):
    s = support_ticket.run("q", backend=engine_backend, temperature=0)
    with pytest.raises(KeyError, match="no variable 'nope'"):
        s["nope"]


def test_run_batch_reports_failed_programs(engine_backend):
    @sgl.function
    def maybe_fail(s, n):
        s += f"Number {n}:" + gen("x", max_tokens=2)
        if n == 3:
            raise ValueError("three is not allowed")

    with pytest.raises(sgl.BatchError, match="1 of 5 programs failed.*#3.*three") as info:
        maybe_fail.run_batch([{"n": n} for n in range(5)], backend=engine_backend, temperature=0)
    assert set(info.value.errors) == {3}
    assert info.value.states[0]["x"] is not None and info.value.states[3] is None
