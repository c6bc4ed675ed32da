// One instruction-set variant of the GGUF block GEMV (see quant_gguf.cpp): included once per variant, inside
// that variant's namespace and `#pragma GCC target` region, with QG_LANES set to its vector width in floats.
// Written with GCC vector extensions rather than intrinsics, so the same source compiles to AVX-512 (16
// lanes), AVX2 + FMA (8) or the portable baseline (4, SSE2) and every variant can run on this CPU in tests.
//
// Blocks are de-quantized in registers, QG_LANES values at a time, and multiplied into every input row while
// they are there: each block is read from memory once per product whatever the row count. Each input row
// has its own NACC accumulators and sums its blocks in one fixed order, so a row's result does not depend on
// the other rows (batch-invariant).

typedef float vfloat __attribute__((vector_size(QG_LANES * 4)));
typedef int32_t vint __attribute__((vector_size(QG_LANES * 4)));
typedef uint32_t vuint __attribute__((vector_size(QG_LANES * 4)));
typedef uint8_t vbyte __attribute__((vector_size(QG_LANES)));

// Everything is inlined into the row loop, so that one row's accumulators stay in registers.
#define QG_INLINE __attribute__((always_inline)) inline

constexpr int LANES = QG_LANES;
constexpr int NACC = 4;   // accumulators per input row: independent FMA chains

QG_INLINE vfloat load_f(const float* p) { vfloat v; __builtin_memcpy(&v, p, sizeof v); return v; }
QG_INLINE vbyte load_b(const uint8_t* p) { vbyte v; __builtin_memcpy(&v, p, sizeof v); return v; }
QG_INLINE vfloat splat(float s) { return vfloat{} + s; }
// Bytes are widened to 32-bit lanes before any shift or mask (x86 has no byte shifts: GCC scalarizes them on
// some targets), and only unsigned bytes are converted (GCC 12 scalarizes the signed-byte conversion): signed
// values are stored or computed with an offset that the caller subtracts, exactly, in float.
QG_INLINE vint widen(const uint8_t* p) { return __builtin_convertvector(load_b(p), vint); }
QG_INLINE vfloat to_f(vint v) { return __builtin_convertvector(v, vfloat); }

// (bytes at p >> shift) & mask, in 32-bit lanes. With 16 lanes (AVX-512BW) shifting the bytes first is
// faster (measured: Q4_0 / Q4_K / Q6_K GEMVs 3-4x); with 8 or 4 lanes widening first is (Q4_K 1.5x).
QG_INLINE vint bits(const uint8_t* p, int shift, int mask) {
#if QG_LANES == 16
  return __builtin_convertvector(static_cast<vbyte>((load_b(p) >> shift) & static_cast<uint8_t>(mask)), vint);
#else
  return (widen(p) >> shift) & mask;
#endif
}

QG_INLINE float half_to_float(const uint8_t* p) {   // IEEE binary16, exact (normals, subnormals, inf, NaN)
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0) {   // zero or subnormal: man * 2^-24, exact
    const float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  const uint32_t bits = exp == 0x1F ? (sign | 0x7F800000 | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

// The lane's bit of a little-endian bit field: lane i of the result is bit (first + i) of `bits`, as 0 / 16.
QG_INLINE vint high_bit16(uint32_t bits, int first) {
  vuint idx;
  for (int i = 0; i < LANES; ++i) idx[i] = static_cast<uint32_t>(first + i);
  const vuint bit = ((vuint{} + bits) >> idx) & 1u;
  return __builtin_convertvector(bit << 4, vint);
}

// Rows of x are `stride` floats apart; acc holds NACC vectors per row.
template <int T>
struct Rows {
  const float* x;
  int64_t stride;
  int64_t n;   // T when T > 0
  vfloat* acc;
  QG_INLINE int64_t count() const { return T > 0 ? T : n; }
  QG_INLINE void fma(vfloat w, int64_t at, int slot) const {
    for (int64_t t = 0; t < count(); ++t) {
      acc[t * NACC + slot] += w * load_f(x + t * stride + at);
    }
  }
};

// A sink that writes the de-quantized values of a row instead.
struct Store {
  float* out;
  QG_INLINE void fma(vfloat w, int64_t at, int) const { __builtin_memcpy(out + at, &w, sizeof w); }
};

// Each block function hands the block's values (value `at` of the row on), LANES at a time, to the sink:
// Rows multiplies them into every input row's accumulators, Store writes them out.
template <typename Sink>
QG_INLINE void block_q8_0(const uint8_t* b, int64_t at, const Sink& r) {
  const float d = half_to_float(b);
  for (int c = 0; c < 32 / LANES; ++c) {
    const vbyte biased = load_b(b + 2 + c * LANES) ^ 0x80;   // int8 q as q + 128
    r.fma((to_f(__builtin_convertvector(biased, vint)) - 128.0f) * d, at + c * LANES, c % NACC);
  }
}

// Q4_0 / Q4_1 / Q5_0 / Q5_1: 32 values; value v's low 4 bits are nibble (v / 16) of byte v % 16.
template <bool HIGH, bool MIN, typename Sink>
QG_INLINE void block_q4_q5(const uint8_t* b, int64_t at, const Sink& r) {
  const float d = half_to_float(b);
  const float m = MIN ? half_to_float(b + 2) : 0.0f;
  const uint8_t* qh = b + (MIN ? 4 : 2);
  const uint8_t* qs = qh + (HIGH ? 4 : 0);
  uint32_t hbits = 0;
  if (HIGH) __builtin_memcpy(&hbits, qh, 4);
  const float offset = MIN ? 0.0f : (HIGH ? 16.0f : 8.0f);
  for (int c = 0; c < 32 / LANES; ++c) {
    const int v0 = c * LANES;
    vint q = bits(qs + v0 % 16, v0 >= 16 ? 4 : 0, 0x0F);
    if (HIGH) q |= high_bit16(hbits, v0);
    const vfloat w = MIN ? d * to_f(q) + m : (to_f(q) - offset) * d;
    r.fma(w, at + v0, c % NACC);
  }
}

// The 8 six-bit (scale, min) pairs of a Q4_K / Q5_K block (ggml's get_scale_min_k4), times d and dmin.
QG_INLINE void k_scales(const uint8_t* b, float* dsc, float* dmn) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  const uint8_t* q = b + 4;
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    if (j < 4) {
      sc = q[j] & 63;
      mn = q[j + 4] & 63;
    } else {
      sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
    dsc[j] = d * static_cast<float>(sc);
    dmn[j] = dmin * static_cast<float>(mn);
  }
}

// Q4_K (HIGH = false) / Q5_K: 8 sub-blocks of 32; value v = 32 s + l: nibble (s % 2) of qs[32 (s / 2) + l],
// Q5_K's fifth bit is bit s of qh[l].
template <bool HIGH, typename Sink>
QG_INLINE void block_qk(const uint8_t* b, int64_t at, const Sink& r) {
  float dsc[8], dmn[8];
  k_scales(b, dsc, dmn);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (HIGH ? 48 : 16);
  for (int s = 0; s < 8; ++s) {
    for (int c = 0; c < 32 / LANES; ++c) {
      const int l = c * LANES;
      vint q = bits(qs + 32 * (s / 2) + l, (s % 2) * 4, 0x0F);
      if (HIGH) q |= bits(qh + l, s, 1) << 4;
      r.fma(dsc[s] * to_f(q) - dmn[s], at + 32 * s + l, c % NACC);
    }
  }
}

// Q6_K: two halves of 128; value 128 h + r: nibble (r / 64) of ql[64 h + r % 64], high 2 bits at bit
// 2 (r / 32) of qh[32 h + r % 32], minus 32, times d * scales[v / 16].
template <typename Sink>
QG_INLINE void block_q6_k(const uint8_t* b, int64_t at, const Sink& r) {
  const float d = half_to_float(b + 208);
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  for (int v0 = 0; v0 < 256; v0 += LANES) {
    const int h = v0 / 128, rr = v0 % 128;
    const vint low = bits(b + 64 * h + rr % 64, (rr / 64) * 4, 0x0F);
    const vint high = bits(b + 128 + 32 * h + rr % 32, 2 * (rr / 32), 3);
    const vfloat w = (to_f(low | (high << 4)) - 32.0f) * (d * static_cast<float>(scales[v0 / 16]));
    r.fma(w, at + v0, (v0 / LANES) % NACC);
  }
}

// Every block of one quantized row of k values, handed to the sink (one loop per type).
#define QG_EACH_BLOCK(call)                                                 \
  for (int64_t at = 0, i = 0; at < k; at += block, ++i) {                   \
    const uint8_t* b = row + i * size;                                      \
    call;                                                                   \
  }                                                                         \
  break;

template <typename Sink>
QG_INLINE void for_blocks(int type, const uint8_t* row, int64_t k, const Sink& r) {
  const int64_t block = block_size(type), size = type_size(type);
  switch (type) {
    case Q8_0: QG_EACH_BLOCK(block_q8_0(b, at, r))
    case Q4_0: QG_EACH_BLOCK((block_q4_q5<false, false>(b, at, r)))
    case Q4_1: QG_EACH_BLOCK((block_q4_q5<false, true>(b, at, r)))
    case Q5_0: QG_EACH_BLOCK((block_q4_q5<true, false>(b, at, r)))
    case Q5_1: QG_EACH_BLOCK((block_q4_q5<true, true>(b, at, r)))
    case Q4_K: QG_EACH_BLOCK(block_qk<false>(b, at, r))
    case Q5_K: QG_EACH_BLOCK(block_qk<true>(b, at, r))
    case Q6_K: QG_EACH_BLOCK(block_q6_k(b, at, r))
    default: break;
  }
}
#undef QG_EACH_BLOCK

template <int T>
void gemv_typed(int type, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t row_bytes,
                int64_t n0, int64_t n1, float* out, int64_t n, float* scratch) {
  // one row: the accumulators on the stack, where the compiler keeps them in registers
  vfloat local[T > 0 ? T * NACC : 1];
  vfloat* acc = T > 0 ? local : reinterpret_cast<vfloat*>(scratch);
  const Rows<T> r{x, k, rows, acc};
  for (int64_t j = n0; j < n1; ++j) {
    for (int64_t i = 0; i < r.count() * NACC; ++i) acc[i] = vfloat{};
    const uint8_t* row = w + j * row_bytes;
    for_blocks(type, row, k, r);
    for (int64_t t = 0; t < r.count(); ++t) {   // fixed reduction order: accumulators, then lanes
      vfloat s = (acc[t * NACC] + acc[t * NACC + 1]) + (acc[t * NACC + 2] + acc[t * NACC + 3]);
      float total = 0.0f;
      for (int i = 0; i < LANES; ++i) total += s[i];
      out[t * n + j] = total;
    }
  }
}

// out[t, j] = sum_k x[t, k] * W[j, k] for output rows j in [n0, n1); `scratch`: rows * NACC vectors, aligned
// to 64 bytes (unused for one row).
inline void gemv(int type, const float* x, int64_t rows, int64_t k, const uint8_t* w, int64_t row_bytes,
                 int64_t n0, int64_t n1, float* out, int64_t n, float* scratch) {
  if (rows == 1) {
    gemv_typed<1>(type, x, rows, k, w, row_bytes, n0, n1, out, n, scratch);
  } else {
    gemv_typed<0>(type, x, rows, k, w, row_bytes, n0, n1, out, n, scratch);
  }
}

// out[j - n0, :] = W[j, :] de-quantized, for rows j in [n0, n1).
inline void dequantize(int type, int64_t k, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* out) {
  for (int64_t j = n0; j < n1; ++j) for_blocks(type, w + j * row_bytes, k, Store{out + (j - n0) * k});
}

#undef QG_INLINE
