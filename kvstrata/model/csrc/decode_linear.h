// The contract of decode_linear, whichever build implements it (decode_ops.cpp with AVX-512 BF16,
// decode_linear_avx2.cpp with AVX2): y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), bf16 in and out.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

namespace kvstrata_cpu {

// Raises on inputs the kernels cannot read; returns the bias, contiguous (undefined when there is none).
inline at::Tensor check_decode_linear_args(const at::Tensor& x, const at::Tensor& weight,
                                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "decode_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "decode_linear: bf16 inputs");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "decode_linear: contiguous inputs");
  at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.scalar_type() == at::kBFloat16 && b.numel() == weight.size(0)),
              "decode_linear: bias [N] bf16");
  return b;
}

}  // namespace kvstrata_cpu
