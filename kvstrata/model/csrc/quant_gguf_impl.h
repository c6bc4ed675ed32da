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
// Only unsigned bytes are converted (GCC 12 scalarizes the signed-byte conversion): signed values are stored
// or computed with an offset that the caller subtracts, exactly, in float.
QG_INLINE vint widen(const uint8_t* p) { return __builtin_convertvector(load_b(p), vint); }
QG_INLINE vfloat to_f(vint v) { return __builtin_convertvector(v, vfloat); }

// 64-bit (32-bit for 4-byte vectors) words over a vector of `BYTES` bytes: x86 has no byte shifts, so bit
// fields of packed bytes are cut out with word shifts and a per-byte mask (see shr_mask).
template <int BYTES> struct Words;
template <> struct Words<4> { typedef uint32_t elem; typedef elem type __attribute__((vector_size(4))); };
template <> struct Words<8> { typedef uint64_t elem; typedef elem type __attribute__((vector_size(8))); };
template <> struct Words<16> { typedef uint64_t elem; typedef elem type __attribute__((vector_size(16))); };
template <> struct Words<32> { typedef uint64_t elem; typedef elem type __attribute__((vector_size(32))); };
template <> struct Words<64> { typedef uint64_t elem; typedef elem type __attribute__((vector_size(64))); };

// (v >> shift) & mask in every byte of the byte vector v, by one shift of whole words: with shift + the mask's
// width <= 8 no bit of a neighbouring byte survives the mask. One uniform shift for all the bytes, whatever
// the ISA (a byte-vector shift is emulated, and scalarized by GCC 12 on some targets).
template <typename V>
QG_INLINE V shr_mask(V v, int shift, unsigned mask) {
  typedef Words<sizeof(V)> W;
  const typename W::type w = (typename W::type)v;   // a vector cast: the same bits
  return (V)((w >> shift) & static_cast<typename W::elem>(0x0101010101010101ull * mask));
}

// v << shift in every byte, for byte values small enough not to overflow (the high bits of Q5 / Q6 values).
template <typename V>
QG_INLINE V shl_small(V v, int shift) {
  typedef Words<sizeof(V)> W;
  return (V)((typename W::type)v << shift);
}

// (bytes at p >> shift) & mask, in 32-bit lanes. With 16 lanes (AVX-512BW) shifting the bytes first is
// faster (measured: Q4_0 / Q4_K GEMVs 3-4x); with 8 or 4 lanes widening first is (Q4_K 1.5x).
QG_INLINE vint bits(const uint8_t* p, int shift, unsigned mask) {
#if QG_LANES == 16
  return __builtin_convertvector(static_cast<vbyte>((load_b(p) >> shift) & static_cast<uint8_t>(mask)), vint);
#else
  return (widen(p) >> shift) & static_cast<int>(mask);
#endif
}

// (bytes at p >> shift) & mask as bytes, by word shifts (shr_mask): the high bits of Q5_K / Q6_K values are
// joined to the low ones as bytes, and the value widened once (measured: their GEMVs 2-3x faster than
// widening both parts; the same word shift alone, then widened, is scalarized by GCC 12: see bits()).
QG_INLINE vbyte byte_bits(const uint8_t* p, int shift, unsigned mask) { return shr_mask(load_b(p), shift, mask); }
QG_INLINE vint widen_b(vbyte b) { return __builtin_convertvector(b, vint); }

QG_INLINE float half_to_float(const uint8_t* p) {   // IEEE binary16, exact (normals, subnormals, inf, NaN)
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
#ifdef QG_F16C
  // One instruction: the scales of 32-value blocks are a large part of their work. GCC's builtin, not the
  // intrinsic: the intrinsics carry the file's target options (-march=native), which the AVX2 region's
  // `#pragma GCC target` narrows, and GCC refuses to inline a wider function into a narrower one.
  typedef short half8 __attribute__((vector_size(16)));
  return __builtin_ia32_vcvtph2ps(half8{static_cast<short>(h), 0, 0, 0, 0, 0, 0, 0})[0];
#else
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
#endif
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
      vint q;
      if (HIGH) {   // the fifth bit, joined before widening
        q = widen_b(byte_bits(qs + 32 * (s / 2) + l, (s % 2) * 4, 0x0F) | shl_small(byte_bits(qh + l, s, 1), 4));
      } else {
        q = bits(qs + 32 * (s / 2) + l, (s % 2) * 4, 0x0F);
      }
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
    const vbyte low = byte_bits(b + 64 * h + rr % 64, (rr / 64) * 4, 0x0F);
    const vbyte high = byte_bits(b + 128 + 32 * h + rr % 32, 2 * (rr / 32), 3);
    const vfloat w = (to_f(widen_b(low | shl_small(high, 4))) - 32.0f) * (d * static_cast<float>(scales[v0 / 16]));
    r.fma(w, at + v0, (v0 / LANES) % NACC);
  }
}

// A GEMV streams its weight once, from memory rather than cache. Each block (or step) asks for the bytes
// PREFETCH_BYTES ahead of its own into every cache level as it starts, so that one prefetch goes out per 64
// bytes computed and those loads are in flight while the block computes. Measured on the 1B-class Q4_K_M
// model, all of its products on 2 threads (docs/benchmarks.md, issue 47): 87 ms with no prefetch; 50 ms with
// each row's bytes asked for in one burst as the row started; then, with the 8-bit kernels and huge pages,
// 15.7-17.5 GB/s with the row's burst against 18.5-19.9 GB/s spread over the blocks (a burst of 18 prefetches
// finds the core's 16 line-fill buffers busy and waits). Prefetches past the task's rows are harmless: x86
// prefetches never fault, and the next rows are the next task's.
constexpr int64_t PREFETCH_BYTES = 16384;
template <int BYTES>
QG_INLINE void prefetch_ahead(const uint8_t* p) {
  for (int at = 0; at < BYTES; at += 64) __builtin_prefetch(p + PREFETCH_BYTES + at, 0, 3);
  if (BYTES % 64 != 0) __builtin_prefetch(p + PREFETCH_BYTES + BYTES - 1, 0, 3);
}

// Every block of one quantized row of k values, handed to the sink (one loop per type).
#define QG_EACH_BLOCK(SIZE, call)                                           \
  for (int64_t at = 0, i = 0; at < k; at += block, ++i) {                   \
    const uint8_t* b = row + i * SIZE;                                      \
    prefetch_ahead<SIZE>(b);                                                \
    call;                                                                   \
  }                                                                         \
  break;

template <typename Sink>
QG_INLINE void for_blocks(int type, const uint8_t* row, int64_t k, const Sink& r) {
  const int64_t block = block_size(type);
  switch (type) {
    case Q8_0: QG_EACH_BLOCK(34, block_q8_0(b, at, r))
    case Q4_0: QG_EACH_BLOCK(18, (block_q4_q5<false, false>(b, at, r)))
    case Q4_1: QG_EACH_BLOCK(20, (block_q4_q5<false, true>(b, at, r)))
    case Q5_0: QG_EACH_BLOCK(22, (block_q4_q5<true, false>(b, at, r)))
    case Q5_1: QG_EACH_BLOCK(24, (block_q4_q5<true, true>(b, at, r)))
    case Q4_K: QG_EACH_BLOCK(144, block_qk<false>(b, at, r))
    case Q5_K: QG_EACH_BLOCK(176, block_qk<true>(b, at, r))
    case Q6_K: QG_EACH_BLOCK(210, block_q6_k(b, at, r))
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

// ---------------------------------------------------------------------------------------------------------
// The 8-bit-activation GEMV (gemv_q8), where the including file picked a dot product (QG_DOT_*): each input
// row comes quantized to int8 (Q8Act, quant_gguf.cpp), and the weight's blocks meet it in integer dot products,
// 4 values per 32-bit lane: AVX-512 VNNI's vpdpbusd (u8 x s8 summed into s32, no saturation), AVX2's
// vpmaddubsw + vpmaddwd (pairs summed to s16 first: the unsigned weights stay <= 63 and |x| <= 127, so no pair
// saturates; Q8_0's signed weights go in as |w| times x with w's sign), or plain C.
// - Q8_0 / Q4_0 / Q4_1 (activation scales per 32 values): each lane's sum is scaled once, in float32, by
//   (weight scale x activation scale). Offsets (Q4_0's -8, Q8_0's +128 on VNNI) are exact integer terms
//   prepared with the activation (Q8Act::off).
// - K-quants (one activation scale per 256-value block, llama.cpp's Q8_K): the pair sums are multiplied by the
//   sub-blocks' integer scales and summed in int32 over the whole block (dot_scaled: vpmaddubsw + vpdpwssd,
//   or vpmaddwd), then scaled once per block in float32. Before, every 64 values took a conversion, a multiply
//   and an FMA in float: Q4_K's GEMV spent more time there than in its dot products.
// Mins (Q4_1, Q4_K, Q5_K) and Q6_K's -32 are float terms over the activation's lane, 32- or 16-value sums
// (Q8Act::xl, xs, x16), kept in a vector per row. Weight bytes are unpacked once per step and used by every
// input row.
#if defined(QG_DOT_VNNI512) || defined(QG_DOT_MADDUBS) || defined(QG_DOT_SCALAR)

#if QG_LANES == 16
#define QG_STEP 64
#else
#define QG_STEP 32
#endif
constexpr int STEP = QG_STEP;          // values per step: 4 per 32-bit lane
constexpr int PIECES = QG_STEP / 32;   // 32-value pieces (blocks, K-quant sub-blocks) per step
typedef uint8_t qbytes __attribute__((vector_size(QG_STEP)));
typedef int16_t qshorts __attribute__((vector_size(QG_STEP)));   // one scale per pair of values
typedef int16_t shorts8 __attribute__((vector_size(16)));
typedef int16_t shorts16 __attribute__((vector_size(32)));
typedef int32_t qint __attribute__((vector_size(QG_STEP)));
typedef float qfloat __attribute__((vector_size(QG_STEP)));
typedef uint8_t b16 __attribute__((vector_size(16)));
typedef uint8_t b32 __attribute__((vector_size(32)));
typedef uint32_t words8 __attribute__((vector_size(32)));
typedef float floats8 __attribute__((vector_size(32)));

QG_INLINE qbytes load_qb(const void* p) { qbytes v; __builtin_memcpy(&v, p, sizeof v); return v; }
QG_INLINE qint load_qi(const int32_t* p) { qint v; __builtin_memcpy(&v, p, sizeof v); return v; }
QG_INLINE qfloat load_qf(const float* p) { qfloat v; __builtin_memcpy(&v, p, sizeof v); return v; }
QG_INLINE b16 load16(const uint8_t* p) { b16 v; __builtin_memcpy(&v, p, sizeof v); return v; }
QG_INLINE b32 load32(const uint8_t* p) { b32 v; __builtin_memcpy(&v, p, sizeof v); return v; }

#define QG_I4(n) n, n + 1, n + 2, n + 3
#define QG_I16(n) QG_I4(n), QG_I4(n + 4), QG_I4(n + 8), QG_I4(n + 12)
#define QG_I32(n) QG_I16(n), QG_I16(n + 16)
QG_INLINE b32 cat16(b16 a, b16 b) { return __builtin_shufflevector(a, b, QG_I32(0)); }

// The sum of a step vector's lanes, halves added until one is left (a fixed order; a serial sum of the lanes
// was a tenth of a 2048-value row's time).
QG_INLINE float lane_sum(qfloat v) {
  floats8 h;
#if QG_STEP == 64
  h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, QG_I4(8), QG_I4(12));
#else
  h = v;
#endif
  typedef float floats4 __attribute__((vector_size(16)));
  const floats4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// 8 floats in the first lanes of a step's float vector, zeros above.
QG_INLINE qfloat widen8(floats8 v) {
#if QG_STEP == 64
  return __builtin_shufflevector(v, floats8{}, QG_I16(0));
#else
  return v;
#endif
}

// The weight bytes of one step from its 32-value pieces (b unused where a step is one piece).
QG_INLINE qbytes step_of(b32 a, b32 b) {
#if QG_STEP == 64
  return __builtin_shufflevector(a, b, QG_I32(0), QG_I32(32));
#else
  (void)b;
  return a;
#endif
}

// Lane scales of a step whose pieces have scales a (and b): one per 32 values.
QG_INLINE qfloat spread32(float a, float b) {
#if QG_STEP == 64
  const qint lane = {QG_I16(0)};
  return lane < 8 ? qfloat{} + a : qfloat{} + b;
#else
  (void)b;
  return qfloat{} + a;
#endif
}

#if defined(QG_DOT_VNNI512)
constexpr int Q8_0_OFFSET = 128;   // Q8_0's signed weights go in as w + 128
QG_INLINE qint dot_u8(qint acc, qbytes w, qbytes x) {
  return (qint)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, (__m512i)x);
}
QG_INLINE qint dot_s8(qint acc, qbytes w, qbytes x) { return dot_u8(acc, w ^ 0x80, x); }
// acc + each lane's two pair sums of w x x (w unsigned), each times its pair's scale in sc
QG_INLINE qint dot_scaled(qint acc, qbytes w, qbytes x, qshorts sc) {
  return (qint)_mm512_dpwssd_epi32((__m512i)acc, _mm512_maddubs_epi16((__m512i)w, (__m512i)x), (__m512i)sc);
}
#elif defined(QG_DOT_MADDUBS)
// GCC's builtins rather than the intrinsics, for the reason given at half_to_float.
constexpr int Q8_0_OFFSET = 0;
typedef char sbytes __attribute__((vector_size(32)));
typedef short shorts __attribute__((vector_size(32)));
QG_INLINE qint pair_sums(sbytes w, sbytes x) {
  return (qint)__builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256(w, x), shorts{} + 1);
}
QG_INLINE qint dot_u8(qint acc, qbytes w, qbytes x) { return acc + pair_sums((sbytes)w, (sbytes)x); }
QG_INLINE qint dot_s8(qint acc, qbytes w, qbytes x) {
  return acc + pair_sums(__builtin_ia32_psignb256((sbytes)w, (sbytes)w), __builtin_ia32_psignb256((sbytes)x, (sbytes)w));
}
QG_INLINE qint dot_scaled(qint acc, qbytes w, qbytes x, qshorts sc) {
  return acc + (qint)__builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256((sbytes)w, (sbytes)x), (shorts)sc);
}
#else
constexpr int Q8_0_OFFSET = 0;
template <bool SIGNED>
QG_INLINE qint dot_c(qint acc, qbytes w, qbytes x) {
  for (int i = 0; i < STEP / 4; ++i) {
    int32_t sum = 0;
    for (int j = 4 * i; j < 4 * i + 4; ++j) {
      const int32_t wj = SIGNED ? static_cast<int8_t>(w[j]) : w[j];
      sum += wj * static_cast<int8_t>(x[j]);
    }
    acc[i] += sum;
  }
  return acc;
}
QG_INLINE qint dot_u8(qint acc, qbytes w, qbytes x) { return dot_c<false>(acc, w, x); }
QG_INLINE qint dot_s8(qint acc, qbytes w, qbytes x) { return dot_c<true>(acc, w, x); }
QG_INLINE qint dot_scaled(qint acc, qbytes w, qbytes x, qshorts sc) {
  for (int i = 0; i < STEP / 2; ++i) {
    const int32_t pair = w[2 * i] * static_cast<int8_t>(x[2 * i]) + w[2 * i + 1] * static_cast<int8_t>(x[2 * i + 1]);
    acc[i / 2] += pair * sc[i];
  }
  return acc;
}
#endif

// The integer offset each type's weight bytes carry (the activation's `off` is -offset x its lane sums; Q6_K's
// -32 is a float term over x16 instead, as its sums are scaled in integers first).
inline int q8_offset(int type) {
  switch (type) {
    case Q8_0: return Q8_0_OFFSET;
    case Q4_0: return 8;
    default: return 0;
  }
}

// The input rows of a product with 8-bit activations; acc: 2 vectors per row, macc: 1 vector per row (the min
// terms, kept in lanes: a scalar sum per block was a dependency chain that took a third of Q4_K's time), iacc:
// 1 vector per row (a K-quant block's integer sums).
template <int T>
struct Q8Rows {
  const Q8Act& a;
  int64_t n;
  qfloat* acc;
  qfloat* macc;
  qint* iacc;
  QG_INLINE int64_t count() const { return T > 0 ? T : n; }
  // Values [at, at + STEP) of every row: weight bytes w (signed for Q8_0), lane scales ws.
  template <bool OFFSET, bool SIGNED>
  QG_INLINE void step(qbytes w, int64_t at, qfloat ws, int slot) const {
    const int64_t lanes = a.k / 4;
    for (int64_t t = 0; t < count(); ++t) {
      const qbytes x = load_qb(a.q + t * a.k + at);
      const qint init = OFFSET ? load_qi(a.off + t * lanes + at / 4) : qint{};
      const qint dot = SIGNED ? dot_s8(init, w, x) : dot_u8(init, w, x);
      acc[t * 2 + slot] += __builtin_convertvector(dot, qfloat) * (ws * load_qf(a.dxl + t * lanes + at / 4));
    }
  }
  // Weight bytes w (unsigned) of values [at, at + STEP) times every row's, pairs scaled by sc, into iacc
  QG_INLINE void scaled(qbytes w, int64_t at, qshorts sc) const {
    for (int64_t t = 0; t < count(); ++t) iacc[t] = dot_scaled(iacc[t], w, load_qb(a.q + t * a.k + at), sc);
  }
  // The end of a K-quant block at `at`: every row's integer sums times d (the weight's scale) x the row's
  // activation scale, into the row's first accumulator (a fixed one: an index that alternates by block kept
  // the accumulators on the stack, in the block's dependency chain)
  QG_INLINE void close_block(float d, int64_t at) const {
    const int64_t lanes = a.k / 4;
    for (int64_t t = 0; t < count(); ++t) {
      acc[t * 2] += __builtin_convertvector(iacc[t], qfloat) * (d * a.dxl[t * lanes + at / 4]);
      iacc[t] = qint{};
    }
  }
  // m[i] times the sum of every row's values in 16-value group at / 16 + i, for i < 16 (m: 16 floats)
  QG_INLINE void min16(const qfloat* m, int64_t at) const {
    for (int64_t t = 0; t < count(); ++t) {
      for (int i = 0; i < 64 / STEP; ++i) macc[t] += m[i] * load_qf(a.x16 + t * (a.k / 16) + at / 16 + i * (STEP / 4));
    }
  }
  // Lane scales m times every row's lane sums of values [at, at + STEP) (the mins of 32-value blocks)
  QG_INLINE void min(qfloat m, int64_t at) const {
    const int64_t lanes = a.k / 4;
    for (int64_t t = 0; t < count(); ++t) macc[t] += m * load_qf(a.xl + t * lanes + at / 4);
  }
  // m[i] times the sum of every row's values in 32-value block g + i, for i < 8
  QG_INLINE void min8(floats8 m, int64_t g) const {
    for (int64_t t = 0; t < count(); ++t) {
      floats8 xs;
      __builtin_memcpy(&xs, a.xs + t * (a.k / 32) + g, sizeof xs);
      macc[t] += widen8(m * xs);
    }
  }
};

// Q8_0: PIECES blocks from b.
template <typename Sink>
QG_INLINE void q8_q8_0(const uint8_t* b, int64_t at, const Sink& r, int slot) {
  const uint8_t* last = b + (PIECES - 1) * 34;
  r.template step<(Q8_0_OFFSET != 0), true>(step_of(load32(b + 2), load32(last + 2)), at,
                                            spread32(half_to_float(b), half_to_float(last)), slot);
}

// Q4_0 / Q4_1: PIECES blocks from b; value v is nibble (v / 16) of byte v % 16.
template <bool MIN, typename Sink>
QG_INLINE void q8_q4(const uint8_t* b, int64_t at, const Sink& r, int slot) {
  constexpr int size = MIN ? 20 : 18;
  const uint8_t* last = b + (PIECES - 1) * size;
  const b16 q0 = load16(b + size - 16), q1 = load16(last + size - 16);
  const b32 w0 = cat16(shr_mask(q0, 0, 0x0F), shr_mask(q0, 4, 0x0F));
  const b32 w1 = cat16(shr_mask(q1, 0, 0x0F), shr_mask(q1, 4, 0x0F));
  r.template step<!MIN, false>(step_of(w0, w1), at, spread32(half_to_float(b), half_to_float(last)), slot);
  if (MIN) r.min(spread32(half_to_float(b + 2), half_to_float(last + 2)), at);
}

// The 8 six-bit scales and mins of a Q4_K / Q5_K block (ggml's get_scale_min_k4), by word operations on the
// 12 packed bytes: scale j < 4 is q[j] & 63, min j < 4 q[j + 4] & 63; for j >= 4 the low four bits come from
// q[j + 4] (scale: low nibble, min: high nibble), the top two from q[j - 4] (scale) or q[j] (min) >> 6. Each
// half's 4 bytes are spread over 32-bit lanes by variable shifts, not byte converts. The scales are returned as
// integers (they scale the integer sums), the mins as floats times -dmin (the terms the block's sums are
// subtracted with).
QG_INLINE void k_scales(const uint8_t* b, shorts8* sc, floats8* mn) {
  uint32_t w0, w1, w2;
  __builtin_memcpy(&w0, b + 4, 4);
  __builtin_memcpy(&w1, b + 8, 4);
  __builtin_memcpy(&w2, b + 12, 4);
  const uint32_t low6 = 0x3F3F3F3Fu, low4 = 0x0F0F0F0Fu, top2 = 0x03030303u;
  const uint32_t sc_hi = (w2 & low4) | (((w0 >> 6) & top2) << 4);
  const uint32_t mn_hi = ((w2 >> 4) & low4) | (((w1 >> 6) & top2) << 4);
  const words8 shifts = {0, 8, 16, 24, 0, 8, 16, 24};
  const words8 s8 = {w0 & low6, w0 & low6, w0 & low6, w0 & low6, sc_hi, sc_hi, sc_hi, sc_hi};
  const words8 m8 = {w1 & low6, w1 & low6, w1 & low6, w1 & low6, mn_hi, mn_hi, mn_hi, mn_hi};
  *sc = __builtin_convertvector((s8 >> shifts) & 0xFFu, shorts8);
  *mn = __builtin_convertvector((m8 >> shifts) & 0xFFu, floats8) * -half_to_float(b + 2);
}

#if QG_STEP == 64
// With 64-value steps (AVX-512) a K-quant block is read 64 bytes at a time. Q4_K / Q5_K's 64 bytes hold
// sub-blocks 4c and 4c + 2 in their low nibbles and 4c + 1, 4c + 3 in their high ones, so the activation of
// these types comes with the sub-blocks of each 256 values stored in the order 0 2 1 3 4 6 5 7
// (q8_interleaved): each nibble half then meets its 64 activation bytes with no byte shuffle (measured on a
// 512 x 2048 Q4_K weight in L2: 0.056 -> 0.045 ms; the natural order took two 32-byte loads and a permute).
constexpr bool q8_interleaved(int type) { return type == Q4_K || type == Q5_K; }

// Pair scales for sub-blocks A (the step's first 32 values) and B (the last 32) of a block's 8 scales. One
// permute of the scales' register (GCC's shufflevector from 8 lanes to 32 went through the stack, and the
// 64-byte load of a 16-byte store stalled: Q4_K's GEMV took twice as long).
template <int A, int B>
QG_INLINE qshorts pair_scales(shorts8 sc) {
  const qshorts index = {A, A, A, A, A, A, A, A, A, A, A, A, A, A, A, A, B, B, B, B, B, B, B, B, B, B, B, B, B, B, B, B};
  return (qshorts)_mm512_permutexvar_epi16((__m512i)index, _mm512_castsi128_si512((__m128i)sc));
}

// Pair scales of a step over 16-value groups G .. G + 3 of a block's 16 scales.
template <int G>
QG_INLINE qshorts quad_scales(shorts16 sc) {
  const qshorts index = {G, G, G, G, G, G, G, G, G + 1, G + 1, G + 1, G + 1, G + 1, G + 1, G + 1, G + 1,
                         G + 2, G + 2, G + 2, G + 2, G + 2, G + 2, G + 2, G + 2, G + 3, G + 3, G + 3, G + 3, G + 3,
                         G + 3, G + 3, G + 3};
  return (qshorts)_mm512_permutexvar_epi16((__m512i)index, _mm512_castsi256_si512((__m256i)sc));
}

// bytes >> shift & mask with one shift for the low 32 bytes and another for the high 32 (qh bit fields).
QG_INLINE qbytes shr_mask_halves(qbytes v, int low, int high, unsigned mask) {
  typedef uint64_t words __attribute__((vector_size(64)));
  const words shifts = {uint64_t(low), uint64_t(low), uint64_t(low), uint64_t(low),
                        uint64_t(high), uint64_t(high), uint64_t(high), uint64_t(high)};
  return (qbytes)(((words)v >> shifts) & (0x0101010101010101ull * mask));
}

QG_INLINE qbytes twice32(const uint8_t* p) {   // 32 bytes in both halves
  const b32 h = load32(p);
  return __builtin_shufflevector(h, h, QG_I32(0), QG_I32(0));
}

// Q4_K / Q5_K: qs as two 64-byte chunks (low nibbles: sub-blocks 4c, 4c + 2; high: 4c + 1, 4c + 3); Q5_K's
// fifth bit of value l of sub-block s is bit s of qh[l].
template <bool HIGH, typename Sink>
QG_INLINE void q8_qk(const uint8_t* b, int64_t at, const Sink& r) {
  shorts8 sc;
  floats8 mn;
  k_scales(b, &sc, &mn);
  const uint8_t* qs = b + (HIGH ? 48 : 16);
  const qbytes qh = HIGH ? twice32(b + 16) : qbytes{};
  const qbytes v0 = load_qb(qs), v1 = load_qb(qs + 64);
  qbytes w0 = shr_mask(v0, 0, 0x0F), w1 = shr_mask(v0, 4, 0x0F);
  qbytes w2 = shr_mask(v1, 0, 0x0F), w3 = shr_mask(v1, 4, 0x0F);
  if (HIGH) {
    w0 |= shl_small(shr_mask_halves(qh, 0, 2, 1), 4);
    w1 |= shl_small(shr_mask_halves(qh, 1, 3, 1), 4);
    w2 |= shl_small(shr_mask_halves(qh, 4, 6, 1), 4);
    w3 |= shl_small(shr_mask_halves(qh, 5, 7, 1), 4);
  }
  r.scaled(w0, at, pair_scales<0, 2>(sc));
  r.scaled(w1, at + 64, pair_scales<1, 3>(sc));
  r.scaled(w2, at + 128, pair_scales<4, 6>(sc));
  r.scaled(w3, at + 192, pair_scales<5, 7>(sc));
  r.close_block(half_to_float(b), at);
  r.min8(mn, at / 32);
}

// Q6_K: half h's 64 bytes of ql hold values 128 h + 0..63 in their low nibbles and 128 h + 64..127 in their
// high ones, in order; the high 2 bits of value 128 h + i are bits 2 (i / 32) of qh[32 h + i % 32]. Times
// scales[v / 16] in integers, d once per block; the -32 is a float term: -32 d scales[g] x the sum of group g.
template <typename Sink>
QG_INLINE void q8_q6_k(const uint8_t* b, int64_t at, const Sink& r) {
  const __m128i scale_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  const shorts16 sc = (shorts16)_mm256_cvtepi8_epi16(scale_bytes);
  const float d = half_to_float(b + 208);
  for (int h = 0; h < 2; ++h) {
    const qbytes ql = load_qb(b + 64 * h), qh = twice32(b + 128 + 32 * h);
    const qbytes w0 = shr_mask(ql, 0, 0x0F) | shl_small(shr_mask_halves(qh, 0, 2, 3), 4);
    const qbytes w1 = shr_mask(ql, 4, 0x0F) | shl_small(shr_mask_halves(qh, 4, 6, 3), 4);
    r.scaled(w0, at + 128 * h, h == 0 ? quad_scales<0>(sc) : quad_scales<8>(sc));
    r.scaled(w1, at + 128 * h + 64, h == 0 ? quad_scales<4>(sc) : quad_scales<12>(sc));
  }
  r.close_block(d, at);
  const qfloat offset = __builtin_convertvector((qint)_mm512_cvtepi8_epi32(scale_bytes), qfloat) * (-32.0f * d);
  r.min16(&offset, at);
}
#else
constexpr bool q8_interleaved(int) { return false; }

// Q4_K / Q5_K: sub-block s is nibble (s % 2) of qs[32 (s / 2) ...], Q5_K's fifth bit is bit s of qh[l].
template <bool HIGH, typename Sink>
QG_INLINE void q8_qk(const uint8_t* b, int64_t at, const Sink& r) {
  shorts8 sc;
  floats8 mn;
  k_scales(b, &sc, &mn);
  const uint8_t* qs = b + (HIGH ? 48 : 16);
  const b32 qh = load32(b + 16);
#pragma GCC unroll 8
  for (int s = 0; s < 8; ++s) {
    b32 w = shr_mask(load32(qs + 32 * (s / 2)), (s % 2) * 4, 0x0F);
    if (HIGH) w |= shl_small(shr_mask(qh, s, 1), 4);
    r.scaled(w, at + 32 * s, qshorts{} + sc[s]);
  }
  r.close_block(half_to_float(b), at);
  r.min8(mn, at / 32);
}

// Q6_K: value 128 h + r is nibble (r / 64) of ql[64 h + r % 64] with bits 2 (r / 32) of qh[32 h + r % 32] on
// top, times scales[v / 16] in integers and d once per block; the -32 is a float term: -32 d scales[g] x the
// sum of group g.
template <typename Sink>
QG_INLINE void q8_q6_k(const uint8_t* b, int64_t at, const Sink& r) {
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_to_float(b + 208);
  const qshorts first_group = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
#pragma GCC unroll 8
  for (int v0 = 0; v0 < 256; v0 += STEP) {
    const int h = v0 / 128, r0 = v0 % 128;
    const b32 w = shr_mask(load32(b + 64 * h + r0 % 64), 4 * (r0 / 64), 0x0F) |
                  shl_small(shr_mask(load32(b + 128 + 32 * h), 2 * (r0 / 32), 3), 4);
    const int16_t s0 = scales[v0 / 16], s1 = scales[v0 / 16 + 1];
    r.scaled(w, at + v0, first_group == 0 ? qshorts{} + s0 : qshorts{} + s1);
  }
  r.close_block(d, at);
  qfloat offset[2];
  for (int i = 0; i < 16; ++i) offset[i / 8][i % 8] = static_cast<float>(scales[i]) * (-32.0f * d);
  r.min16(offset, at);
}
#endif

// Every step of one quantized row of k values (k a multiple of STEP), each prefetching its bytes ahead.
#define QG_EACH_STEP(VALUES, SIZE, call)                                    \
  for (int64_t at = 0; at < k; at += VALUES) {                              \
    const uint8_t* b = row + at / VALUES * SIZE;                            \
    prefetch_ahead<SIZE>(b);                                                \
    call;                                                                   \
  }                                                                         \
  break;

template <typename Sink>
QG_INLINE void q8_blocks(int type, const uint8_t* row, int64_t k, const Sink& r) {
  switch (type) {
    case Q8_0: QG_EACH_STEP(STEP, PIECES * 34, q8_q8_0(b, at, r, (at / STEP) % 2))
    case Q4_0: QG_EACH_STEP(STEP, PIECES * 18, q8_q4<false>(b, at, r, (at / STEP) % 2))
    case Q4_1: QG_EACH_STEP(STEP, PIECES * 20, q8_q4<true>(b, at, r, (at / STEP) % 2))
    case Q4_K: QG_EACH_STEP(256, 144, q8_qk<false>(b, at, r))
    case Q5_K: QG_EACH_STEP(256, 176, q8_qk<true>(b, at, r))
    case Q6_K: QG_EACH_STEP(256, 210, q8_q6_k(b, at, r))
    default: break;
  }
}
#undef QG_EACH_STEP

template <int T>
void gemv_q8_typed(int type, const Q8Act& a, int64_t rows, const uint8_t* w, int64_t row_bytes, int64_t n0,
                   int64_t n1, float* out, int64_t n, float* scratch) {
  qfloat local[T > 0 ? 2 * T : 1], mlocal[T > 0 ? T : 1];
  qint ilocal[T > 0 ? T : 1];
  qfloat* acc = T > 0 ? local : reinterpret_cast<qfloat*>(scratch);
  qfloat* macc = T > 0 ? mlocal : acc + 2 * rows;
  qint* iacc = T > 0 ? ilocal : reinterpret_cast<qint*>(acc + 3 * rows);
  const Q8Rows<T> r{a, rows, acc, macc, iacc};
  for (int64_t j = n0; j < n1; ++j) {
    for (int64_t i = 0; i < r.count(); ++i) {
      acc[2 * i] = acc[2 * i + 1] = qfloat{};
      macc[i] = qfloat{};
      iacc[i] = qint{};
    }
    q8_blocks(type, w + j * row_bytes, a.k, r);
    for (int64_t t = 0; t < r.count(); ++t) {   // fixed order: the accumulators, then the lanes as a tree
      out[t * n + j] = lane_sum((acc[2 * t] + acc[2 * t + 1]) + macc[t]);
    }
  }
}

// out[t, j] = sum_k x[t, k] * W[j, k] with x quantized in `a`, for output rows j in [n0, n1); `scratch`:
// rows x 4 vectors, aligned to 64 bytes (unused for one row).
inline void gemv_q8(int type, const Q8Act& a, int64_t rows, const uint8_t* w, int64_t row_bytes, int64_t n0,
                    int64_t n1, float* out, int64_t n, float* scratch) {
  // A fixed row count keeps the accumulators in registers (measured on the 1B-class Q4_K_M model: 8 rows
  // took 3.5x one row's time through the scratch accumulators).
  switch (rows) {
    case 1: gemv_q8_typed<1>(type, a, rows, w, row_bytes, n0, n1, out, n, scratch); break;
    case 2: gemv_q8_typed<2>(type, a, rows, w, row_bytes, n0, n1, out, n, scratch); break;
    case 4: gemv_q8_typed<4>(type, a, rows, w, row_bytes, n0, n1, out, n, scratch); break;
    case 8: gemv_q8_typed<8>(type, a, rows, w, row_bytes, n0, n1, out, n, scratch); break;
    case 16: gemv_q8_typed<16>(type, a, rows, w, row_bytes, n0, n1, out, n, scratch); break;
    default: gemv_q8_typed<0>(type, a, rows, w, row_bytes, n0, n1, out, n, scratch);
  }
}

#undef QG_I4
#undef QG_I16
#undef QG_I32
#undef QG_STEP
#endif  // QG_DOT_*

#undef QG_INLINE
