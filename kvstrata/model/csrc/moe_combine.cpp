// The last step of a mixture-of-experts block: each token's k expert outputs, weighted by its routing weights
// and summed in rank order, read straight from the rows the experts wrote in expert order (no scatter back to
// token order, no float32 copies of them): out[t] = sum_r w[t, r] * rows[slots[t, r]], r = 0, 1, ..., k-1.
//
// Rounds like the torch path it replaces (moe.py): each product rounded to float32, then added in rank order
// (rank 0 first), the sum rounded once to the output dtype. So a token's bits depend only on its own rows
// and weights, never on the batch or the threads, and equal the torch path's (the tests compare them bit for
// bit). Products are not fused into the additions: an FMA would round once where torch rounds twice.

#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

template <typename T>
void combine_token(const T* rows, const int64_t* slots, const float* weights, int64_t k, int64_t hidden,
                   float* acc, T* out) {
  const T* first = rows + slots[0] * hidden;
  for (int64_t h = 0; h < hidden; ++h) acc[h] = static_cast<float>(first[h]) * weights[0];
  for (int64_t r = 1; r < k; ++r) {
    const T* row = rows + slots[r] * hidden;
    const float w = weights[r];
    for (int64_t h = 0; h < hidden; ++h) {
      const float product = static_cast<float>(row[h]) * w;
      acc[h] = acc[h] + product;
    }
  }
  for (int64_t h = 0; h < hidden; ++h) out[h] = static_cast<T>(acc[h]);
}

at::Tensor moe_combine(const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& weights) {
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous(), "moe_combine: rows must be a contiguous [N, H] tensor");
  TORCH_CHECK(rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16,
              "moe_combine: rows must be float32 or bfloat16, got ", rows.scalar_type());
  TORCH_CHECK(slots.dim() == 2 && slots.is_contiguous() && slots.scalar_type() == at::kLong,
              "moe_combine: slots must be a contiguous int64 [T, k] tensor");
  TORCH_CHECK(weights.sizes() == slots.sizes() && weights.is_contiguous() && weights.scalar_type() == at::kFloat,
              "moe_combine: weights must be a contiguous float32 tensor shaped like slots");
  const int64_t tokens = slots.size(0), k = slots.size(1), hidden = rows.size(1), n = rows.size(0);
  TORCH_CHECK(k > 0, "moe_combine: k must be at least 1");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < tokens * k; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < n, "moe_combine: slot ", slot[i], " outside the ", n, " rows");
  at::Tensor out = at::empty({tokens, hidden}, rows.options());
  const float* weight = weights.data_ptr<float>();
  auto run = [&](const auto* src, auto* dst) {
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(hidden);
      for (int64_t t = begin; t < end; ++t)
        combine_token(src, slot + t * k, weight + t * k, k, hidden, acc.data(), dst + t * hidden);
    });
  };
  if (rows.scalar_type() == at::kFloat)
    run(rows.data_ptr<float>(), out.data_ptr<float>());
  else
    run(rows.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvstrata, m) {
  m.def("moe_combine(Tensor rows, Tensor slots, Tensor weights) -> Tensor");
  m.impl("moe_combine", c10::DispatchKey::CPU, TORCH_FN(moe_combine));
}
