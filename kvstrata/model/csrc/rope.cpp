// Rotary position embedding in one pass (rope.py's apply_rotary, HF "rotate_half" layout): for every head of
// token t, out[i] = x[i] * cos[t, i] + x[i +- D/2] * signed_sin[t, i], with torch's roundings: the product
// x * cos rounded to the dtype (torch's mul), then one fused multiply-add rounded again (torch's addcmul,
// which fuses on CPU). The torch path takes four ops (mul, flip, its copy, addcmul) of ~5-10 us each per
// layer at decode sizes; this op reads x once and writes the result once.
//
// Plain loops that GCC vectorizes for the build's ISA (AVX2 or AVX-512); no intrinsics.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

// c10's conversions (bf16 rounded to nearest even, NaN kept quiet) are bit operations that GCC vectorizes.
inline float widen(float v) { return v; }
inline float widen(bf16 v) { return static_cast<float>(v); }

template <typename T>
inline T narrow(float v) { return static_cast<T>(v); }

// One head row of D values; c and s hold the token's cos and signed sin in float32.
template <typename T>
inline void rotate_row(const T* x, const float* c, const float* s, T* out, int64_t D, float* xf) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) xf[i] = widen(x[i]);
  for (int64_t i = 0; i < half; ++i)
    out[i] = narrow<T>(std::fma(xf[i + half], s[i], widen(narrow<T>(xf[i] * c[i]))));
  for (int64_t i = half; i < D; ++i)
    out[i] = narrow<T>(std::fma(xf[i - half], s[i], widen(narrow<T>(xf[i] * c[i]))));
}

template <typename T>
void rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin, at::Tensor& out) {
  const int64_t T_ = x.size(0), H = x.size(1), D = x.size(2), row_stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = signed_sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // ~16K values per task: a decode step's few tokens stay on one thread (no fork/join).
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(H * D, 1));
  at::parallel_for(0, T_, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(3 * D);
    float* c = scratch.data();
    float* s = c + D;
    float* xf = s + D;
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < D; ++i) {
        c[i] = widen(cp[t * D + i]);
        s[i] = widen(sp[t * D + i]);
      }
      for (int64_t h = 0; h < H; ++h) rotate_row<T>(xp + t * row_stride + h * D, c, s, op + (t * H + h) * D, D, xf);
    }
  });
}

at::Tensor rope_rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rope_rotate: x [T, heads, head_dim] with an even head_dim and contiguous heads");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "rope_rotate: bf16 or float32");
  for (const at::Tensor* table : {&cos, &signed_sin}) {
    TORCH_CHECK(table->scalar_type() == x.scalar_type() && table->is_contiguous() &&
                    table->numel() == x.size(0) * x.size(2) && table->size(0) == x.size(0),
                "rope_rotate: cos and signed_sin [T, 1, head_dim] (or [T, head_dim]), contiguous, in x's dtype");
  }
  at::Tensor out = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    rotate<bf16>(x, cos, signed_sin, out);
  else
    rotate<float>(x, cos, signed_sin, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvstrata, m) {
  m.def("rope_rotate(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
  m.impl("rope_rotate", c10::DispatchKey::CPU, TORCH_FN(rope_rotate));
}
