"""kvstrata.lang: SGLang-style frontend programs (`function`, `gen`, `select`, roles, `fork`, `run_batch`).

    from kvstrata.lang import function, gen, user, assistant, RuntimeEndpoint, set_default_backend

    @function
    def generate_json(s):
        s += user("Generate an object with name, age and city")
        s += assistant(gen("json_output", max_tokens=100, regex=r"\\{.*\\}"))

    set_default_backend(RuntimeEndpoint("http://127.0.0.1:30000"))
    print(generate_json.run()["json_output"])

An SGLang program runs after changing only its import (`import kvstrata.lang as sgl`).
"""

from kvstrata.lang.api import flush_cache, get_default_backend, get_server_info, set_default_backend
from kvstrata.lang.backends import Backend, BackendError, EngineBackend, RuntimeEndpoint
from kvstrata.lang.chat_template import ChatTemplateError
from kvstrata.lang.choices import (
    ChoicesMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from kvstrata.lang.interpreter import ProgramError
from kvstrata.lang.ir import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from kvstrata.lang.program import SglFunction, function
from kvstrata.lang.run_batch import BatchError
from kvstrata.lang.state import ProgramState, ProgramStateGroup

__all__ = [
    "Backend", "BackendError", "BatchError", "ChatTemplateError", "ChoicesMethod", "EngineBackend", "ProgramError",
    "ProgramState", "ProgramStateGroup", "RuntimeEndpoint", "SglFunction", "assistant", "assistant_begin",
    "assistant_end", "flush_cache", "function", "gen", "gen_int", "gen_string", "get_default_backend",
    "get_server_info", "greedy_token_selection", "select", "set_default_backend", "system", "system_begin",
    "system_end", "token_length_normalized", "unconditional_likelihood_normalized", "user", "user_begin",
    "user_end",
]
