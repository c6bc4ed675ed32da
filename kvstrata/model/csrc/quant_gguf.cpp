// Products with weights held in GGUF block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K):
//
// gguf_gemv(x [T, K] float32/bf16/fp16, blocks [N, row_bytes] uint8, type, variant) -> x @ W.T [T, N] in x's
//   dtype, computed in float32. Blocks
//   are de-quantized in registers and multiplied into every input row: the weight is read once per product
//   (decode is a stream over it). Row-invariant (quant_gguf_impl.h), so deterministic mode runs every
//   product through it.
// The same product with 8-bit activations (variants Q8_*): each input row is quantized to int8, one scale per
//   q8_block(type) values (32; 256 for the K-quants, llama.cpp's Q8_K: scale max|x| / 127, rounded to nearest
//   even: QuantizedRows below; gguf_blocks.quantize_activation_q8 is the torch reference) and multiplied with the
//   blocks in integer dot products (AVX-512 VNNI, AVX2, portable C), as llama.cpp does. Also row-invariant.
//   BEST picks, per type, the faster of the two ways on this build (best_variant, measured in
//   docs/benchmarks.md).
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

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>   // F16C, AVX2 and AVX-512 VNNI intrinsics of the variants below
#endif

#include <algorithm>
#include <cmath>
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

// Values per activation scale for a product with `type`'s weight: a K-quant block's 8 or 16 sub-blocks then
// sum in integers, scaled once per block (llama.cpp's Q8_K); other types' blocks are 32 values.
inline int64_t q8_block(int type) { return type >= Q4_K ? 256 : 32; }

// Input rows quantized to int8 for the 8-bit GEMV: per row, k values q, and per 32-bit lane (4 values) the
// scale of the value's activation block (dxl), -offset x the lane's sum of q (off: the weight type's integer
// offset, exact) and the scale x the lane's sum of q (xl: Q4_1's min terms); per 32 values the scale x their sum
// of q (xs: Q4_K / Q5_K's min terms), and per 16 values the same (x16: Q6_K's offset terms).
struct Q8Act {
  const int8_t* q;       // [rows, k]
  const float* dxl;      // [rows, k / 4]
  const int32_t* off;    // [rows, k / 4]
  const float* xl;       // [rows, k / 4]
  const float* xs;       // [rows, k / 32]
  const float* x16;      // [rows, k / 16]
  int64_t k;
};

// F16C's scale conversion in the AVX variants (`#pragma GCC target` does not undefine __F16C__ where it
// turns AVX off, so the portable variant must not see it)
#if defined(__F16C__)
#define QG_F16C 1
#endif

#if defined(__AVX512F__) && defined(__GNUC__)
#define QG_HAS_AVX512 1
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QG_HAS_VNNI512 1
#define QG_DOT_VNNI512 1
#endif
namespace avx512 {
#define QG_LANES 16
#include "quant_gguf_impl.h"
#undef QG_LANES
}  // namespace avx512
#undef QG_DOT_VNNI512
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__GNUC__)
#define QG_HAS_AVX2 1
#pragma GCC push_options
#pragma GCC target("no-avx512f")
#define QG_DOT_MADDUBS 1
namespace avx2 {
#define QG_LANES 8
#include "quant_gguf_impl.h"
#undef QG_LANES
}  // namespace avx2
#undef QG_DOT_MADDUBS
#pragma GCC pop_options
#endif

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#pragma GCC push_options
#pragma GCC target("no-avx")
#endif
#undef QG_F16C
#define QG_DOT_SCALAR 1
namespace portable {
#define QG_LANES 4
#include "quant_gguf_impl.h"
#undef QG_LANES
}  // namespace portable
#undef QG_DOT_SCALAR
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#pragma GCC pop_options
#endif

// Variants 1-3 de-quantize the blocks in registers; 4-6 quantize the activation to 8 bits.
enum Variant : int64_t { BEST = 0, PORTABLE = 1, AVX2 = 2, AVX512 = 3, Q8_PORTABLE = 4, Q8_AVX2 = 5, Q8_VNNI512 = 6 };

using GemvFn = void (*)(int, const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*,
                        int64_t, float*);
using Q8Fn = void (*)(int, const Q8Act&, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*, int64_t,
                      float*);

struct Q8Kernel {
  Q8Fn fn;
  int64_t step;          // values per step: k must be a multiple
  int (*offset)(int);    // the integer offset of each type's weight bytes (q8_offset)
  bool (*interleaved)(int);   // whether the type's activation has its sub-blocks paired (q8_interleaved)
};

bool is_q8(int64_t variant) { return variant >= Q8_PORTABLE; }

std::vector<int64_t> variants() {
  std::vector<int64_t> out{PORTABLE, Q8_PORTABLE};
#ifdef QG_HAS_AVX2
  out.push_back(AVX2);
  out.push_back(Q8_AVX2);
#endif
#ifdef QG_HAS_AVX512
  out.push_back(AVX512);
#endif
#ifdef QG_HAS_VNNI512
  out.push_back(Q8_VNNI512);
#endif
  std::sort(out.begin(), out.end());
  return out;
}

bool has_q8_kernel(int type) {
  return type == Q8_0 || type == Q4_0 || type == Q4_1 || type == Q4_K || type == Q5_K || type == Q6_K;
}

// The variants that serve `type` (every de-quantizing one; the 8-bit ones where they have its kernel).
std::vector<int64_t> type_variants(int64_t type) {
  std::vector<int64_t> out;
  for (int64_t v : variants()) {
    if (!is_q8(v) || has_q8_kernel(static_cast<int>(type))) out.push_back(v);
  }
  return out;
}

GemvFn gemv_for(int64_t variant) {
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

Q8Kernel q8_for(int64_t variant) {
  switch (variant) {
#ifdef QG_HAS_VNNI512
    case Q8_VNNI512: return {&avx512::gemv_q8, avx512::STEP, &avx512::q8_offset, &avx512::q8_interleaved};
#endif
#ifdef QG_HAS_AVX2
    case Q8_AVX2: return {&avx2::gemv_q8, avx2::STEP, &avx2::q8_offset, &avx2::q8_interleaved};
#endif
    case Q8_PORTABLE: return {&portable::gemv_q8, portable::STEP, &portable::q8_offset, &portable::q8_interleaved};
    default: TORCH_CHECK(false, "gguf_gemv: variant ", variant, " is not in this build");
  }
}

// The widest build of the faster way for `type` (docs/benchmarks.md, issue 47): 8-bit activations where they
// have the type's kernel and k fits their step (unless `int8_activations` is false: float32 products on the
// exact activation), else de-quantizing in registers. BEST (variant 0) is best_variant(type, k, true).
int64_t best_variant(int type, int64_t k, bool int8_activations) {
  const std::vector<int64_t> all = variants();
  for (auto it = all.rbegin(); it != all.rend() && int8_activations; ++it) {
    if (is_q8(*it) && has_q8_kernel(type) && k % q8_for(*it).step == 0) return *it;
  }
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (!is_q8(*it)) return *it;
  }
  return PORTABLE;
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

// Input rows quantized for the 8-bit GEMV, in buffers this object owns.
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> dxl, xl, xs, x16;
  std::vector<int32_t> off;

  // x [rows, k] float32; `block`: values per scale (q8_block); `offset`: the weight type's integer offset
  // (q8_offset); `interleaved`: the 32-value pieces of every 256 values stored in the order 0 2 1 3 4 6 5 7
  // (q8_interleaved).
  QuantizedRows(const float* x, int64_t rows, int64_t k, int64_t block, int offset, bool interleaved)
      : q(rows * k), dxl(rows * k / 4), xl(rows * k / 4), xs(rows * k / 32), x16(rows * k / 16), off(rows * k / 4) {
    // the rows' blocks back to back (threads split them: deterministic mode quantizes whole prompts)
    at::parallel_for(0, rows * k / block, 8192 / block, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) quantize_block(x, g, block, offset, interleaved);
    });
  }
  Q8Act act(int64_t k) const { return {q.data(), dxl.data(), off.data(), xl.data(), xs.data(), x16.data(), k}; }

 private:
  static int64_t stored_at(int64_t p) {   // the place of 32-value piece p when each 256 values' pairs are swapped
    static constexpr int64_t order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
    return (p & ~int64_t(7)) + order[p & 7];
  }

  // Activation block g of x (`block` values, one scale); its 32-value pieces stored in place, or interleaved.
  // The sums xs and x16 stay in the natural order.
  void quantize_block(const float* x, int64_t g, int64_t block, int offset, bool interleaved) {
    const float* xg = x + block * g;
    float amax = 0.0f;
    for (int64_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(xg[i]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int64_t piece = block / 32 * g; piece < block / 32 * (g + 1); ++piece) {
      const int64_t to = interleaved ? stored_at(piece) : piece;
      const float* xp = x + 32 * piece;
      int32_t sum = 0, half = 0;
      for (int lane = 0; lane < 8; ++lane) {
        int32_t lane_sum = 0;
        for (int i = 4 * lane; i < 4 * lane + 4; ++i) {
          const int32_t v = static_cast<int32_t>(std::nearbyint(xp[i] * id));   // |v| <= 127; to nearest even
          q[32 * to + i] = static_cast<int8_t>(v);
          lane_sum += v;
        }
        dxl[8 * to + lane] = d;
        off[8 * to + lane] = -offset * lane_sum;
        xl[8 * to + lane] = d * static_cast<float>(lane_sum);
        sum += lane_sum;
        if (lane == 3) half = sum;
      }
      xs[piece] = d * static_cast<float>(sum);
      x16[2 * piece] = d * static_cast<float>(half);
      x16[2 * piece + 1] = d * static_cast<float>(sum - half);
    }
  }
};

at::Tensor gemv_f32(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t variant) {
  const int64_t rows = x.size(0), k = x.size(1), n = blocks.size(0);
  check_blocks(blocks, type, k);
  if (variant == BEST) variant = best_variant(static_cast<int>(type), k, true);
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1);
  // per task: rows x 4 accumulators of up to 16 floats (the 8-bit GEMV's float, min and integer sums),
  // 64-byte aligned
  const auto with_scratch = [rows](auto&& body) {
    std::vector<float> scratch(static_cast<size_t>(rows * 4 * 16 + 16));
    body(reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t(63)));
  };
  if (is_q8(variant)) {
    const Q8Kernel kernel = q8_for(variant);
    TORCH_CHECK(has_q8_kernel(static_cast<int>(type)), "gguf_gemv: the 8-bit variants have no kernel for type ", type);
    TORCH_CHECK(k % kernel.step == 0, "gguf_gemv: variant ", variant, " needs K a multiple of ", kernel.step);
    const QuantizedRows quantized(xp, rows, k, q8_block(static_cast<int>(type)), kernel.offset(static_cast<int>(type)),
                                  kernel.interleaved(static_cast<int>(type)));
    const Q8Act act = quantized.act(k);
    at::parallel_for(0, n, GRAIN, [&](int64_t n0, int64_t n1) {
      with_scratch([&](float* scratch) { kernel.fn(static_cast<int>(type), act, rows, wp, row_bytes, n0, n1, op, n, scratch); });
    });
    return out;
  }
  const GemvFn fn = gemv_for(variant);
  at::parallel_for(0, n, GRAIN, [&](int64_t n0, int64_t n1) {
    with_scratch([&](float* scratch) { fn(static_cast<int>(type), xp, rows, k, wp, row_bytes, n0, n1, op, n, scratch); });
  });
  return out;
}

// x in float32, bfloat16 or float16: multiplied in float32, returned in x's dtype (the conversions here rather
// than as two more torch ops per product: a decode step of a 1B model runs 82 products).
at::Tensor gguf_gemv(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t variant) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "gguf_gemv: x must be [T, K] float32, bfloat16 or float16");
  const at::Tensor out = gemv_f32(x.to(at::kFloat).contiguous(), blocks, type, variant);
  return dtype == at::kFloat ? out : out.to(dtype);
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
  m.def("gguf_type_variants(int type) -> int[]", [](int64_t type) { return kvstrata_gguf::type_variants(type); });
  m.def("gguf_best_variant(int type, int k, bool int8_activations) -> int",
        [](int64_t type, int64_t k, bool int8) { return kvstrata_gguf::best_variant(static_cast<int>(type), k, int8); });
}
