// x @ W for W stored in 64-column panels, for the few rows of a decoding step: an XLA FFI
// handler for CPUs (pspec_jax/cpu_kernel.py builds and registers it; docs/design.md section 7).
//
//   x [M, K] float32,  W [P, K, 64] float32 or bfloat16 (panel p holds columns 64p..64p+63),
//   y [M, N] float32 with N <= 64 P (the last panel's padding columns are dropped).
//
// A decoding step reads every weight once for a handful of rows, so it is bound by reading
// the weights. Each panel is one contiguous stream: a thread reads it from memory once, in
// blocks of `kBlockK` rows that stay in cache while every row of x is multiplied by them.
//
// Every output element is one fused multiply-add per k, in k order from zero, whatever M is,
// whichever thread takes its panel and however the rows are blocked: a row's result does not
// depend on how many rows share the call, so a verified tree node computes bit for bit what a
// plain decoding step computes. (The portable path multiplies and adds without fusing, also
// in k order, so the same holds there.)
//
// Threads: the calling thread and a pool of workers take panels from one shared counter, so a
// worker that is late or descheduled never holds the call up. Workers spin briefly between
// calls (a step makes hundreds of them, microseconds apart), then sleep.

#include <sched.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define PSPEC_X86 1
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kWidth = 64;    // columns per panel: pspec_jax.panels.WIDTH
constexpr int64_t kBlockK = 128;  // panel rows per block: 32 KB of float32, kept in cache
constexpr int64_t kMaxRows = 64;  // pspec_jax.cpu_kernel.MAX_ROWS
constexpr int64_t kMaxPanels = 0xffff;  // a call shared by the pool: 4M columns

struct Problem {
  const float* x;  // [m, k]
  const void* w;   // [panels, k, 64], float32 or bfloat16
  float* y;        // [m, n]
  int64_t m, k, n, panels;
  bool bf16;
};

#if PSPEC_X86
// ---------------------------------------------------------------------------------------
// One panel, AVX2 + FMA (16 vector registers of 8 floats).

__attribute__((target("avx2,fma"))) inline __m256 load8(const float* w) {
  return _mm256_loadu_ps(w);
}

__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* w) {
  // bfloat16 is the top half of a float32: widen and shift.
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The lines of the next block still to ask memory for, one per step of a tile's loop.
struct Ahead {
  const char* next;
  const char* end;
};

// R rows of x times columns c0..c0+8C-1 of panel rows k0..k1, accumulated into acc ([R, 64]):
// the R rows share each loaded vector of W, and R*C independent accumulators keep the FMA
// units busy (6 x 2: 12 accumulators, 2 weight vectors, 1 broadcast).
template <typename W, int R, int C>
__attribute__((target("avx2,fma"), always_inline)) inline void tile_avx2(
    const float* x, int64_t ldx, const W* wp, int64_t k0, int64_t k1, int64_t c0, float* acc,
    Ahead& ahead) {
  __m256 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = _mm256_load_ps(acc + r * kWidth + c0 + 8 * c);
  for (int64_t k = k0; k < k1; ++k) {
    if (ahead.next < ahead.end) {
      _mm_prefetch(ahead.next, _MM_HINT_T0);
      ahead.next += 64;
    }
    __m256 w[C];
    for (int c = 0; c < C; ++c) w[c] = load8(wp + k * kWidth + c0 + 8 * c);
    for (int r = 0; r < R; ++r) {
      const __m256 xk = _mm256_broadcast_ss(x + r * ldx + k);
      for (int c = 0; c < C; ++c) a[r][c] = _mm256_fmadd_ps(xk, w[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm256_store_ps(acc + r * kWidth + c0 + 8 * c, a[r][c]);
}

// R rows across the whole panel, C vectors of columns at a time.
template <typename W, int R, int C>
__attribute__((target("avx2,fma"), always_inline)) inline void rows_avx2(
    const float* x, int64_t ldx, const W* wp, int64_t k0, int64_t k1, float* acc, Ahead& ahead) {
  for (int64_t c0 = 0; c0 < kWidth; c0 += 8 * C)
    tile_avx2<W, R, C>(x, ldx, wp, k0, k1, c0, acc, ahead);
}

// The last `rows` (< 6) rows, in the tile shape that fits the registers.
template <typename W>
__attribute__((target("avx2,fma"))) inline void rest_avx2(
    int64_t rows, const float* x, int64_t ldx, const W* wp, int64_t k0, int64_t k1, float* acc,
    Ahead& ahead) {
  switch (rows) {
    case 1: return rows_avx2<W, 1, 8>(x, ldx, wp, k0, k1, acc, ahead);
    case 2: return rows_avx2<W, 2, 4>(x, ldx, wp, k0, k1, acc, ahead);
    case 3: return rows_avx2<W, 3, 2>(x, ldx, wp, k0, k1, acc, ahead);
    case 4: return rows_avx2<W, 4, 2>(x, ldx, wp, k0, k1, acc, ahead);
    case 5: return rows_avx2<W, 5, 2>(x, ldx, wp, k0, k1, acc, ahead);
  }
}

template <typename W>
__attribute__((target("avx2,fma"))) void panel_avx2(const Problem& p, int64_t panel) {
  const W* wp = static_cast<const W*>(p.w) + panel * p.k * kWidth;
  alignas(32) float acc[kMaxRows * kWidth];
  std::memset(acc, 0, sizeof(float) * p.m * kWidth);
  for (int64_t k0 = 0; k0 < p.k; k0 += kBlockK) {
    const int64_t k1 = std::min(k0 + kBlockK, p.k);
    // Row 0 reads the block in order, whole rows of the panel (a sequential stream the
    // hardware prefetcher follows); the other rows find it in cache.
    Ahead none{nullptr, nullptr};
    tile_avx2<W, 1, 8>(p.x, p.k, wp, k0, k1, 0, acc, none);
    // Their tiles ask memory for the next block meanwhile, a line per step: left to the
    // hardware, memory would idle while they compute (measured: 20-25% of the time at 4-16
    // rows).
    const int64_t k2 = std::min(k1 + kBlockK, p.k);
    Ahead ahead{reinterpret_cast<const char*>(wp + k1 * kWidth),
                reinterpret_cast<const char*>(wp + k2 * kWidth)};
    int64_t r = 1;
    for (; r + 6 <= p.m; r += 6)
      rows_avx2<W, 6, 2>(p.x + r * p.k, p.k, wp, k0, k1, acc + r * kWidth, ahead);
    rest_avx2<W>(p.m - r, p.x + r * p.k, p.k, wp, k0, k1, acc + r * kWidth, ahead);
  }
  const int64_t c0 = panel * kWidth, cols = std::min(kWidth, p.n - c0);
  for (int64_t r = 0; r < p.m; ++r) std::memcpy(p.y + r * p.n + c0, acc + r * kWidth, cols * 4);
}

#endif  // PSPEC_X86

// ---------------------------------------------------------------------------------------
// One panel, portable C++: the same loops, multiply then add.

inline float to_float(float v) { return v; }

inline float to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <typename W>
void panel_portable(const Problem& p, int64_t panel) {
  const W* wp = static_cast<const W*>(p.w) + panel * p.k * kWidth;
  float acc[kMaxRows * kWidth];
  std::memset(acc, 0, sizeof(float) * p.m * kWidth);
  for (int64_t k0 = 0; k0 < p.k; k0 += kBlockK) {
    const int64_t k1 = std::min(k0 + kBlockK, p.k);
    for (int64_t r = 0; r < p.m; ++r) {
      float* ar = acc + r * kWidth;
      for (int64_t k = k0; k < k1; ++k) {
        const float xk = p.x[r * p.k + k];
        const W* wk = wp + k * kWidth;
        for (int64_t c = 0; c < kWidth; ++c) ar[c] += xk * to_float(wk[c]);
      }
    }
  }
  const int64_t c0 = panel * kWidth, cols = std::min(kWidth, p.n - c0);
  for (int64_t r = 0; r < p.m; ++r) std::memcpy(p.y + r * p.n + c0, acc + r * kWidth, cols * 4);
}

// ---------------------------------------------------------------------------------------
// Which code runs: AVX2 + FMA where the CPU has it, else portable; PSPEC_JAX_CPU_KERNEL_ISA
// (avx2 | portable) picks one (the tests run both).

using PanelFn = void (*)(const Problem&, int64_t);

struct Isa {
  PanelFn f32, bf16;
  const char* name;
};

Isa choose_isa() {
#if PSPEC_X86
  const char* want = std::getenv("PSPEC_JAX_CPU_KERNEL_ISA");
  __builtin_cpu_init();
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (want != nullptr && std::strcmp(want, "portable") == 0) avx2 = false;
  if (avx2) return {panel_avx2<float>, panel_avx2<uint16_t>, "avx2"};
#endif
  return {panel_portable<float>, panel_portable<uint16_t>, "portable"};
}

const Isa& isa() {
  static const Isa chosen = choose_isa();
  return chosen;
}

// ---------------------------------------------------------------------------------------
// The pool. `next` packs the call's generation (high 32 bits), its number of panels (16 bits)
// and the next panel to take (low 16 bits). A thread takes a panel only with a compare-and-swap
// that sees the generation it read the call under and a panel left to take, so it never reads
// the problem of a call that is not published yet: a late worker can neither take a panel of a
// later call nor see a call's problem half written.

inline void pause() {
#if PSPEC_X86
  _mm_pause();
#endif
}

class Pool {
 public:
  explicit Pool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }

  ~Pool() {
    stop_.store(true);
    {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    for (auto& t : workers_) t.join();
  }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  void run(const Problem& p, PanelFn fn) {
    // Calls from two XLA threads at once: the second computes alone, the cores are busy.
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || workers_.empty() || p.panels < 2 || p.panels > kMaxPanels) {
      for (int64_t i = 0; i < p.panels; ++i) fn(p, i);
      return;
    }
    // No thread reads problem_ now: the last call's panels are all taken and done.
    problem_ = p;
    fn_ = fn;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (next_.load(std::memory_order_relaxed) >> 32) + 1;
    next_.store(gen << 32 | static_cast<uint64_t>(p.panels) << 16, std::memory_order_release);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    take_panels(gen);
    while (done_.load(std::memory_order_acquire) < p.panels) pause();
  }

 private:
  void take_panels(uint64_t gen) {
    uint64_t v = next_.load(std::memory_order_acquire);
    while (true) {
      if ((v >> 32) != gen) return;
      const int64_t panels = static_cast<int64_t>((v >> 16) & 0xffffu);
      const int64_t i = static_cast<int64_t>(v & 0xffffu);
      if (i >= panels) return;
      if (!next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) continue;
      fn_(problem_, i);
      done_.fetch_add(1, std::memory_order_release);
      v = next_.load(std::memory_order_acquire);
    }
  }

  void work() {
    uint64_t seen = 0;
    while (!stop_.load(std::memory_order_relaxed)) {
      uint64_t gen = next_.load(std::memory_order_acquire) >> 32;
      if (gen != seen) {
        seen = gen;
        take_panels(gen);
        continue;
      }
      // Spin for about 200 microseconds, then sleep until the next call.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
      bool woke = false;
      while (!woke && std::chrono::steady_clock::now() < until) {
        for (int i = 0; i < 64; ++i) pause();
        woke = (next_.load(std::memory_order_acquire) >> 32) != seen || stop_.load();
      }
      if (woke) continue;
      std::unique_lock<std::mutex> lock(mu_);
      sleepers_.fetch_add(1);
      cv_.wait(lock, [&] { return (next_.load() >> 32) != seen || stop_.load(); });
      sleepers_.fetch_sub(1);
    }
  }

  std::vector<std::thread> workers_;
  std::atomic<uint64_t> next_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex busy_, mu_;
  std::condition_variable cv_;
  Problem problem_{};
  PanelFn fn_ = nullptr;
};

int default_threads() {
  if (const char* s = std::getenv("PSPEC_JAX_CPU_KERNEL_THREADS")) {
    const int t = std::atoi(s);
    if (t >= 1) return t;
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::min(CPU_COUNT(&set), 8);
  return 1;
}

Pool& pool() {
  static Pool* p = new Pool(default_threads());  // never destroyed: workers outlive exit
  return *p;
}

ffi::Error PanelMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kWidth) {
    return ffi::Error::InvalidArgument("panel_matmul: x [M, K], W [P, K, 64], y [M, N]");
  }
  const bool bf16 = w.element_type() == ffi::DataType::BF16;
  if (!bf16 && w.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("panel_matmul: W must be float32 or bfloat16");
  }
  const int64_t m = xd[0], k = xd[1], n = yd[1], panels = wd[0];
  if (wd[1] != k || yd[0] != m || n > panels * kWidth || m > kMaxRows) {
    return ffi::Error::InvalidArgument("panel_matmul: shapes do not match");
  }
  const Problem p{x.typed_data(), w.untyped_data(), y->typed_data(), m, k, n, panels, bf16};
  pool().run(p, bf16 ? isa().bf16 : isa().f32);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PanelMatmul, PanelMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// What the library reports of the kernel it loaded (pspec_jax.cpu_kernel.describe).
extern "C" const char* pspec_panel_matmul_isa() { return isa().name; }
extern "C" int pspec_panel_matmul_threads() { return pool().threads(); }
