// The contract of the decode GEMV, whichever build implements it (decode_ops.cpp with AVX-512 BF16 on a
// row-major weight, decode_linear_avx2.cpp with AVX2 on a packed one):
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), bf16 in and out.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

namespace kvstrata_cpu {

// Raises on an input the kernels cannot read (x [M, K] bf16, contiguous; a bias of N bf16); returns the bias,
// contiguous (undefined when there is none).
inline at::Tensor check_decode_linear_inputs(const at::Tensor& x, int64_t K, int64_t N,
                                             const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "decode_linear: x [M, K] for a weight of K = ", K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "decode_linear: a contiguous bf16 x");
  at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.scalar_type() == at::kBFloat16 && b.numel() == N), "decode_linear: bias [N] bf16");
  return b;
}

// The same for a row-major weight [N, K].
inline at::Tensor check_decode_linear_args(const at::Tensor& x, const at::Tensor& weight,
                                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "decode_linear: a contiguous bf16 weight [N, K]");
  return check_decode_linear_inputs(x, weight.size(1), weight.size(0), bias);
}

}  // namespace kvstrata_cpu
