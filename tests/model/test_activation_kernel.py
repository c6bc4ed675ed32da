"""The compiled silu(gate) * up (csrc/activation.cpp) gives the same bits as the two torch ops it replaces,
alone, for every bf16 gate value, and inside a model forward. AVX-512 BF16 builds without AMX compute silu
with their own exp; the others look up torch's own silu of every bf16 value (AMX builds by vpgatherdd). On
an AVX-512 BF16 CPU the other one of those two builds is compiled here too. Skipped without a C++ compiler."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvstrata.model import paged_kernels
from kvstrata.model.layers import use_fused_activation
from kvstrata.model.paged_kernels import silu_and_mul_op
from kvstrata.platform import cpu_has_amx
from tests.capabilities import requires_avx512_bf16, requires_cpu_kernels
from tests.model.pairs import PROMPT_LENS, Pair, random_prompts
from tests.model.silu_cases import every_gate_value, same_bits

OP = silu_and_mul_op()
pytestmark = requires_cpu_kernels


@pytest.mark.parametrize("rows,inter", [(1, 1536), (5, 1000), (300, 64), (2, 7)])
def test_same_bits_as_torch(rows, inter):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * inter, generator=g) * 4).to(torch.bfloat16)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])   # saturated exp either way, and zeros
    gate, up = x.split(inter, dim=-1)
    assert torch.equal(OP(x), F.silu(gate) * up)


@pytest.mark.parametrize("inter", [1536, 7], ids=["torch-vector-loop", "torch-scalar-loop"])
def test_every_bf16_gate_value(inter):
    """silu of a bf16 depends on its 16 bits only: all 65,536 of them, where torch's own loop is vectorized
    (rows of 1536) and where it is scalar (rows of 7, another exp), against random up values."""
    x, want = every_gate_value(inter)
    assert same_bits(OP(x), want)


OTHER_BUILD = textwrap.dedent("""
    import sys
    import torch
    from torch.utils import cpp_extension
    from tests.model.silu_cases import every_gate_value, same_bits

    cpp_extension.load(name="kvstrata_silu_other", sources=[sys.argv[1]], build_directory=sys.argv[2],
                       extra_cflags=sys.argv[3].split(), extra_ldflags=["-fopenmp"], is_python_module=False)
    for inter in (1536, 7):
        x, want = every_gate_value(inter)
        assert same_bits(torch.ops.kvstrata.silu_and_mul(x), want), inter
    print("ok")
""")


@requires_avx512_bf16   # the two AVX-512 BF16 builds run on AVX-512 BF16 CPUs
def test_the_other_avx512_bf16_build(tmp_path):
    """AMX CPUs gather the table; the others (Zen 4) compute silu. The build this CPU does not make is compiled
    here (activation.cpp alone, in a subprocess) and checked on every gate value."""
    has_amx = cpu_has_amx()
    amx = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"] if has_amx else ["-mamx-tile", "-mamx-bf16"]
    source = Path(paged_kernels.__file__).parent / "csrc" / "activation.cpp"
    flags = " ".join(["-O3", "-march=native", *amx, "-fopenmp"])
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", OTHER_BUILD, str(source), str(tmp_path), flags], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_model_forward_unchanged(checkpoint_dir):
    pair = Pair.get(checkpoint_dir, "llama", torch.bfloat16)
    prompts = random_prompts(PROMPT_LENS, pair.config.vocab_size)
    logits = []
    try:
        for op in (OP, None):
            use_fused_activation(pair.ours, op)
            logits.append(pair.prefill_logits(prompts))
    finally:
        use_fused_activation(pair.ours, None)   # the Pair is shared with other tests
    assert torch.equal(logits[0], logits[1])


def test_rejects_what_it_does_not_serve():
    with pytest.raises(RuntimeError, match="contiguous"):
        OP(torch.randn(2, 6))
    with pytest.raises(RuntimeError, match="contiguous"):
        OP(torch.randn(2, 5).to(torch.bfloat16))
