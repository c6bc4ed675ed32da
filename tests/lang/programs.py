"""The programs the lang tests run (each test runs them through both backends)."""

from __future__ import annotations

import kvstrata.lang as sgl
from kvstrata.lang import assistant, gen, select, system, user

SYSTEM_PROMPT = ("You are a terse assistant for a company that serves language models. You answer in one "
                 "short sentence and never apologize.")

SHARED_PREFIX = ("Here is a long description of the key-value cache of a serving engine: pages live on the "
                 "device, in host memory, or in storage, and a radix tree finds the longest cached prefix. ")

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

COLOR_SCHEMA = {"enum": ["red", "green", "blue"]}

FEW_SHOT = [("What is 2 + 2?", "4"), ("What colour is the sky?", "Blue"), ("How many legs has a cat?", "Four")]


@sgl.function
def multi_turn_chat(s, question_1, question_2):
    s += system(SYSTEM_PROMPT)
    s += user(question_1)
    s += assistant(gen("answer_1", max_tokens=12))
    s += user(question_2)
    s += assistant(gen("answer_2", max_tokens=12))


@sgl.function
def few_shot_qa(s, question):
    for q, a in FEW_SHOT:
        s += f"Q: {q}\nA: {a}\n\n"
    s += f"Q: {question}\nA:" + gen("answer", max_tokens=24)   # stop: run(stop=...)


@sgl.function
def pick_city(s, choices_method=sgl.token_length_normalized):
    s += user("What is the capital of France? Answer with one word.")
    s += assistant(select("city", ["Paris", "London", "Berlin", "Ulaanbaatar"], choices_method=choices_method))


@sgl.function
def branches(s, n, mode="gather_variable"):
    s += SHARED_PREFIX
    forks = s.fork(n)
    for i, branch in enumerate(forks):
        branch += f"Point {i + 1}:" + gen("point", max_tokens=8)
    forks.join(mode)


@sgl.function
def constrained(s):
    s += user("Give me a phone extension, a number, a person and a colour.")
    s += assistant_regex()


def assistant_regex():
    """An assistant turn with three constrained fields."""
    return assistant("ext " + gen("ext", max_tokens=12, regex=r"[0-9]{3}-[0-9]{2}") + "\nnumber "
                     + sgl.gen_int("number", max_tokens=8) + "\nperson "
                     + gen("person", max_tokens=48, json_schema=PERSON_SCHEMA) + "\ncolor "
                     + gen("color", max_tokens=48, json_schema=COLOR_SCHEMA))


@sgl.function
def generate_json(s):
    s += user("Generate an object with name, age and city")
    s += assistant(gen("json_output", max_tokens=100, regex=r"\{.*\}"))


@sgl.function
def support_ticket(s, question):
    s += system(SYSTEM_PROMPT)
    s += user(question)
    s += assistant(gen("reply", max_tokens=8))
