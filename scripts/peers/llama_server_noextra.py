"""llama-cpp-python's OpenAI server with use_extra_bufts=False (its AMX matmul crashes on this Xeon: GPF in
ggml_backend_amx_mul_mat on the second 2048-token request). Same CLI as `python -m llama_cpp.server`."""
import runpy

import llama_cpp.llama_cpp as lc

_orig = lc.llama_model_default_params


def _params():
    p = _orig()
    p.use_extra_bufts = False
    return p


lc.llama_model_default_params = _params
runpy.run_module("llama_cpp.server", run_name="__main__")
