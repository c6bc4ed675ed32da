// The hot path of the tensor-parallel ranks' shared-memory collectives (model/shm_collectives.py holds the
// protocol, the segment's layout, the sleeping wait and the plain-torch path that computes the same bits).
//
// shm_publish_wait: copy this rank's piece of a round into its slot, post every peer's semaphore for it,
//   then poll each peer's post in rank order for at most `spin_s`. Returns -1 when every peer's piece is in,
//   else the first peer still missing (the ones before it were taken): the caller sleeps on that one and
//   the rest. In Python the same poll costs ~50 us a call at a decode row, on caches a layer's GEMVs just
//   evicted; here a few microseconds (torch.ops calls release the GIL while they run).
// shm_sum_slots_: out = slot 0 + slot 1 + ... in rank order (16-bit floats accumulated in float32 and rounded
//   once, as torch's add does): every rank gets the same bits, and two ranks get torch.add's.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <semaphore.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <ctime>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KV_PAUSE() _mm_pause()
#else
#define KV_PAUSE() ((void)0)
#endif

namespace {

// sem[r][j] ("j -> r: round k is in my slot") sits `line` bytes after sem[r][j - 1]; row r follows row r - 1.
sem_t* sem_at(int64_t sems, int64_t line, int64_t size, int64_t r, int64_t j) {
  return reinterpret_cast<sem_t*>(sems + line * (r * size + j));
}

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

int64_t shm_publish_wait(const at::Tensor& piece, int64_t sems, int64_t line, int64_t slots, int64_t slot_bytes,
                         int64_t rank, int64_t size, double spin_s, bool publish) {
  TORCH_CHECK(piece.device().is_cpu() && piece.is_contiguous(), "shm_publish_wait: a contiguous CPU tensor");
  TORCH_CHECK(0 <= rank && rank < size, "shm_publish_wait: rank ", rank, " of ", size);
  const int64_t nbytes = piece.numel() * piece.element_size();
  TORCH_CHECK(nbytes <= slot_bytes, "shm_publish_wait: ", nbytes, " bytes do not fit a ", slot_bytes, "-byte slot");
  if (publish && nbytes) std::memcpy(reinterpret_cast<void*>(slots + rank * slot_bytes), piece.data_ptr(), nbytes);
  for (int64_t peer = 0; peer < size; ++peer)   // sem_post is a release: the copy above is visible to its waiter
    if (peer != rank && sem_post(sem_at(sems, line, size, peer, rank)) != 0)
      TORCH_CHECK(false, "rank ", rank, ": sem_post failed: ", std::strerror(errno));
  const double deadline = now_s() + spin_s;
  for (int64_t peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    sem_t* sem = sem_at(sems, line, size, rank, peer);
    while (sem_trywait(sem) != 0) {   // an acquire when it succeeds
      if (errno != EAGAIN && errno != EINTR) TORCH_CHECK(false, "rank ", rank, ": sem_trywait failed: ", std::strerror(errno));
      if (now_s() > deadline) return peer;
      for (int i = 0; i < 16; ++i) KV_PAUSE();
    }
  }
  return -1;
}

// A slot as a tensor shaped like `like` (no copy).
at::Tensor slot_view(int64_t slots, int64_t slot_bytes, int64_t j, const at::Tensor& like) {
  return at::from_blob(reinterpret_cast<void*>(slots + j * slot_bytes), like.sizes(), like.options());
}

// bf16 bits of a float, rounded to nearest even as torch rounds (a NaN stays a NaN: 0x7FC0, where torch's
// vectorized add may keep another payload). Written on integers so that GCC vectorizes the loop below.
inline uint16_t bf16_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t rounded = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
  return (x & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

inline float bf16_value(uint16_t b) {
  const uint32_t x = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &x, 4);
  return f;
}

// Two ranks' bf16 slots: a prefill's [2048, 512] activation is 2 MiB; torch's bf16 add took most of its
// all-reduce (0.78 ms, 0.62-0.70 with this loop; kvstrata bench tp-collectives).
void sum_two_bf16(uint16_t* out, const uint16_t* a, const uint16_t* b, int64_t n) {
  at::parallel_for(0, n, 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) out[i] = bf16_bits(bf16_value(a[i]) + bf16_value(b[i]));
  });
}

// The same sums as ShmCollectives._sum (torch's add kernels, in the same order): the same bits, without its
// Python; two ranks' bf16 slots through the vectorized loop above.
void shm_sum_slots_(at::Tensor& out, int64_t slots, int64_t slot_bytes, int64_t size) {
  TORCH_CHECK(out.device().is_cpu() && out.is_contiguous(), "shm_sum_slots_: a contiguous CPU tensor");
  TORCH_CHECK(out.numel() * out.element_size() <= slot_bytes, "shm_sum_slots_: the output exceeds a slot");
  TORCH_CHECK(size >= 2, "shm_sum_slots_: at least two ranks");
  if (size == 2 && out.scalar_type() == at::kBFloat16) {
    sum_two_bf16(reinterpret_cast<uint16_t*>(out.data_ptr()), reinterpret_cast<const uint16_t*>(slots),
                 reinterpret_cast<const uint16_t*>(slots + slot_bytes), out.numel());
    return;
  }
  const bool half = out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf;
  if (size == 2 || !half) {   // a 16-bit add computes in float32 and rounds once
    at::add_out(out, slot_view(slots, slot_bytes, 0, out), slot_view(slots, slot_bytes, 1, out));
    for (int64_t j = 2; j < size; ++j) out.add_(slot_view(slots, slot_bytes, j, out));
    return;
  }
  at::Tensor acc = slot_view(slots, slot_bytes, 0, out).to(at::kFloat);
  for (int64_t j = 1; j < size; ++j) acc.add_(slot_view(slots, slot_bytes, j, out));
  out.copy_(acc);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvstrata, m) {
  m.def("shm_publish_wait(Tensor piece, int sems, int line, int slots, int slot_bytes, int rank, int size, "
        "float spin_s, bool publish) -> int");
  m.impl("shm_publish_wait", c10::DispatchKey::CPU, TORCH_FN(shm_publish_wait));
  m.def("shm_sum_slots_(Tensor(a!) out, int slots, int slot_bytes, int size) -> ()");
  m.impl("shm_sum_slots_", c10::DispatchKey::CPU, TORCH_FN(shm_sum_slots_));
}
