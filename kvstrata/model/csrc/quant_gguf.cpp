// Products with weights held in GGUF block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K):
//
// gguf_gemv(x [T, K] float32, blocks [N, row_bytes] uint8, type, variant) -> x @ W.T [T, N] float32. Blocks
//   are de-quantized in registers and multiplied into every input row: the weight is read once per product
//   (decode is a stream over it). Row-invariant (quant_gguf_impl.h), so deterministic mode runs every
//   product through it.
// gguf_dequantize(blocks [R, row_bytes], type, K) -> [R, K] float32: the tiles of a prefill's GEMM, and
//   embedding rows.
//
// The variants are one source (quant_gguf_impl.h, GCC vector extensions) compiled three times under
// `#pragma GCC target`: AVX-512 (16 lanes, where the build has __AVX512F__), AVX2 + FMA (8 lanes, where it has
// __AVX2__) and the portable baseline (4 lanes, no AVX): each CPU runs the widest it has, and tests run every
// variant the CPU can (gguf_variants()). Threads split the output rows.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace kvstrata_gguf {

// ggml's type ids
enum : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

inline int64_t block_size(int type) { return type >= Q4_K ? 256 : 32; }

inline int64_t type_size(int type) {
  switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}

#if defined(__AVX512F__) && defined(__GNUC__)
#define QG_HAS_AVX512 1
namespace avx512 {
#define QG_LANES 16
#include "quant_gguf_impl.h"
#undef QG_LANES
}  // namespace avx512
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__GNUC__)
#define QG_HAS_AVX2 1
#pragma GCC push_options
#pragma GCC target("no-avx512f")
namespace avx2 {
#define QG_LANES 8
#include "quant_gguf_impl.h"
#undef QG_LANES
}  // namespace avx2
#pragma GCC pop_options
#endif

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#pragma GCC push_options
#pragma GCC target("no-avx")
#endif
namespace portable {
#define QG_LANES 4
#include "quant_gguf_impl.h"
#undef QG_LANES
}  // namespace portable
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#pragma GCC pop_options
#endif

enum Variant : int64_t { BEST = 0, PORTABLE = 1, AVX2 = 2, AVX512 = 3 };

using GemvFn = void (*)(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*,
                        int64_t, float*);

std::vector<int64_t> variants() {
  std::vector<int64_t> out{PORTABLE};
#ifdef QG_HAS_AVX2
  out.push_back(AVX2);
#endif
#ifdef QG_HAS_AVX512
  out.push_back(AVX512);
#endif
  return out;
}

GemvFn gemv_for(int64_t variant) {
  if (variant == BEST) variant = variants().back();
  switch (variant) {
#ifdef QG_HAS_AVX512
    case AVX512: return &avx512::gemv;
#endif
#ifdef QG_HAS_AVX2
    case AVX2: return &avx2::gemv;
#endif
    case PORTABLE: return &portable::gemv;
    default: TORCH_CHECK(false, "gguf_gemv: variant ", variant, " is not in this build");
  }
}

void check_blocks(const at::Tensor& blocks, int64_t type, int64_t k) {
  TORCH_CHECK(type_size(static_cast<int>(type)) > 0, "gguf: unsupported block type ", type);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "gguf: blocks must be a contiguous [rows, row_bytes] uint8 tensor");
  TORCH_CHECK(k % block_size(static_cast<int>(type)) == 0 &&
                  blocks.size(1) == k / block_size(static_cast<int>(type)) * type_size(static_cast<int>(type)),
              "gguf: ", blocks.size(1), " bytes per row do not hold ", k, " values of type ", type);
}

constexpr int64_t GRAIN = 16;   // output rows per task

at::Tensor gguf_gemv(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t variant) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "gguf_gemv: x must be [T, K] float32");
  const int64_t rows = x.size(0), k = x.size(1), n = blocks.size(0);
  check_blocks(blocks, type, k);
  const GemvFn fn = gemv_for(variant);
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1);
  at::parallel_for(0, n, GRAIN, [&](int64_t n0, int64_t n1) {
    // per task: rows x 4 accumulators of up to 16 floats, 64-byte aligned
    std::vector<float> scratch(static_cast<size_t>(rows * 4 * 16 + 16));
    float* aligned = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63));
    fn(static_cast<int>(type), xp, rows, k, wp, row_bytes, n0, n1, op, n, aligned);
  });
  return out;
}

at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t type, int64_t k) {
  check_blocks(blocks, type, k);
  const int64_t rows = blocks.size(0), row_bytes = blocks.size(1);
  at::Tensor out = at::empty({rows, k}, blocks.options().dtype(at::kFloat));
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, GRAIN, [&](int64_t r0, int64_t r1) {
#ifdef QG_HAS_AVX512
    avx512::dequantize(static_cast<int>(type), k, wp, row_bytes, r0, r1, op + r0 * k);
#elif defined(QG_HAS_AVX2)
    avx2::dequantize(static_cast<int>(type), k, wp, row_bytes, r0, r1, op + r0 * k);
#else
    portable::dequantize(static_cast<int>(type), k, wp, row_bytes, r0, r1, op + r0 * k);
#endif
  });
  return out;
}

}  // namespace kvstrata_gguf

TORCH_LIBRARY_FRAGMENT(kvstrata, m) {
  m.def("gguf_gemv(Tensor x, Tensor blocks, int type, int variant) -> Tensor");
  m.impl("gguf_gemv", c10::DispatchKey::CPU, TORCH_FN(kvstrata_gguf::gguf_gemv));
  m.def("gguf_dequantize(Tensor blocks, int type, int k) -> Tensor");
  m.impl("gguf_dequantize", c10::DispatchKey::CPU, TORCH_FN(kvstrata_gguf::gguf_dequantize));
  m.def("gguf_variants() -> int[]", [] { return kvstrata_gguf::variants(); });
}
