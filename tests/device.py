"""The device the numerics and engine tests run on: the CPU, or what KVSTRATA_TEST_DEVICE names.

CI has no GPU, so the default is "cpu". On a CUDA machine, `KVSTRATA_TEST_DEVICE=cuda` runs the same tests
(transformers comparisons, cache configurations, tiers) on the GPU; `scripts/cuda_check.sh` does that.
"""

from __future__ import annotations

import os

import torch

TEST_DEVICE = torch.device(os.environ.get("KVSTRATA_TEST_DEVICE") or "cpu")
