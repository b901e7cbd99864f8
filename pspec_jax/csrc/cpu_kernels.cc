// The CPU kernels of decoding: XLA FFI handlers (pspec_jax/cpu_kernel.py builds and registers
// them; docs/design.md section 7).
//
// PanelMatmul: x @ W for W stored in 64-column panels, for the few rows of a decoding step; one
// call takes 1 to 4 weights that multiply the same rows (y_j = x @ W_j).
//
//   x [M, K] float32,  W_j [P, K, 64] float32 or bfloat16 (panel p holds columns 64p..64p+63),
//   y_j [M, N] float32 with N <= 64 P (the last panel's padding columns are dropped).
//
// W_j may also be block-quantised panels, [P, K/32, B] uint8, as GGUF stores them (Q4_1: B =
// 1536, Q8_0: B = 2304; see "Block-quantised panels" below), a fifth of the bytes, multiplied
// as llama.cpp multiplies them: x quantised to 8 bits per 32 k, integer dot products per block.
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
// DecodeAttention: one layer's attention for the new tokens of a decoding step or a tree
// verification, over the key/value cache and the new tokens themselves (see its section).
//
// Threads: the calling thread and a pool of workers take tasks (panels, or a sequence's
// key/value head) from one shared counter, so a worker that is late or descheduled never
// holds the call up. Workers spin briefly between calls (a step makes hundreds of them,
// microseconds apart), then sleep. A thread that waits (the caller for the tasks the workers
// took, a worker for the next call) gives up its core at every look once a short spin is over
// (`Backoff`): where more threads are runnable than there are cores (other processes, a test
// suite's workers), the thread it waits for then runs, instead of waiting for the spinner's
// time slice to end.

#include <sched.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#define PSPEC_X86 1
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kWidth = 64;    // columns per panel: pspec_jax.panels.WIDTH
// Panel rows per block: 16 KB of float32, half of a typical 32 KB L1, so the block, the rows'
// accumulators and their inputs stay in L1 while the tiles read it. 128-row blocks (32 KB)
// made products of 4 to 8 rows 5-12% slower on a 2-core AMD EPYC (Zen 4).
constexpr int64_t kBlockK = 64;
constexpr int64_t kMaxRows = 64;  // pspec_jax.cpu_kernel.MAX_ROWS

struct QuantRows;

struct Problem {
  const float* x;  // [m, k]
  const void* w;   // [panels, k, 64] float32 or bfloat16, or [panels, k / 32, B] uint8 blocks
  float* y;        // [m, n]
  int64_t m, k, n, panels;
  const QuantRows* quant;  // block-quantised weights: x's rows quantised (see below)
};

// The lines of the next block still to ask memory for, one per step of a tile's loop.
struct Ahead {
  const char* next;
  const char* end;
};

#if PSPEC_X86
// ---------------------------------------------------------------------------------------
// Tiles, AVX2 + FMA (16 vector registers of 8 floats).

__attribute__((target("avx2,fma"))) inline __m256 load8(const float* w) {
  return _mm256_loadu_ps(w);
}

__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* w) {
  // bfloat16 is the top half of a float32: widen and shift.
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

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
      _mm_prefetch(ahead.next, _MM_HINT_T2);
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

// ---------------------------------------------------------------------------------------
// Tiles, AVX-512 (32 vector registers of 16 floats): a tile is R rows across the whole panel
// (4 vectors), so a weight vector is loaded once per k for R rows. The arithmetic per output
// element is the AVX2 path's (one FMA per k, in k order from zero): the two give the same
// bits. On cores with full-width 512-bit FMA units (AMD Zen 5, Intel server cores) the
// arithmetic of many rows takes half the cycles (a model's products of 16 rows: 15 against
// 21 ms on a 2-core Zen 5, where one row takes 12); with half-width units (Zen 4) it does the
// same work in half the instructions.

__attribute__((target("avx512f"))) inline __m512 load16(const float* w) {
  return _mm512_loadu_ps(w);
}

__attribute__((target("avx512f"))) inline __m512 load16(const uint16_t* w) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

constexpr int kVecs512 = kWidth / 16;

// R rows of x times panel rows k0..k1, accumulated into acc ([R, 64]): R*4 accumulators, 4
// weight vectors and a broadcast (6 rows: 29 of the 32 registers).
template <typename W, int R>
__attribute__((target("avx512f"), always_inline)) inline void tile_avx512(
    const float* x, int64_t ldx, const W* wp, int64_t k0, int64_t k1, float* acc, Ahead& ahead) {
  __m512 a[R][kVecs512];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs512; ++c) a[r][c] = _mm512_load_ps(acc + r * kWidth + 16 * c);
  for (int64_t k = k0; k < k1; ++k) {
    // A panel row's lines of the next block per step (the AVX2 tiles, a quarter of the panel
    // wide, ask for one line each): a group of rows asks for the whole block in its pass.
    for (size_t line = 0; line < kWidth * sizeof(W) / 64 && ahead.next < ahead.end; ++line) {
      _mm_prefetch(ahead.next, _MM_HINT_T2);
      ahead.next += 64;
    }
    __m512 w[kVecs512];
    for (int c = 0; c < kVecs512; ++c) w[c] = load16(wp + k * kWidth + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 xk = _mm512_set1_ps(x[r * ldx + k]);
      for (int c = 0; c < kVecs512; ++c) a[r][c] = _mm512_fmadd_ps(xk, w[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs512; ++c) _mm512_store_ps(acc + r * kWidth + 16 * c, a[r][c]);
}

template <typename W>
__attribute__((target("avx512f"))) inline void rest_avx512(
    int64_t rows, const float* x, int64_t ldx, const W* wp, int64_t k0, int64_t k1, float* acc,
    Ahead& ahead) {
  switch (rows) {
    case 1: return tile_avx512<W, 1>(x, ldx, wp, k0, k1, acc, ahead);
    case 2: return tile_avx512<W, 2>(x, ldx, wp, k0, k1, acc, ahead);
    case 3: return tile_avx512<W, 3>(x, ldx, wp, k0, k1, acc, ahead);
    case 4: return tile_avx512<W, 4>(x, ldx, wp, k0, k1, acc, ahead);
    case 5: return tile_avx512<W, 5>(x, ldx, wp, k0, k1, acc, ahead);
  }
}

template <typename W>
struct Avx2Tiles {
  __attribute__((target("avx2,fma"))) static void first(const float* x, int64_t ldx, const W* wp,
                                                       int64_t k0, int64_t k1, float* acc) {
    Ahead none{nullptr, nullptr};
    tile_avx2<W, 1, 8>(x, ldx, wp, k0, k1, 0, acc, none);
  }
  __attribute__((target("avx2,fma"))) static void six(const float* x, int64_t ldx, const W* wp,
                                                     int64_t k0, int64_t k1, float* acc,
                                                     Ahead& ahead) {
    rows_avx2<W, 6, 2>(x, ldx, wp, k0, k1, acc, ahead);
  }
  __attribute__((target("avx2,fma"))) static void rest(int64_t rows, const float* x, int64_t ldx,
                                                      const W* wp, int64_t k0, int64_t k1,
                                                      float* acc, Ahead& ahead) {
    rest_avx2<W>(rows, x, ldx, wp, k0, k1, acc, ahead);
  }
};

// Row 0 keeps the AVX2 tile (`first`, inherited): its pass is bound by memory, and the 512-bit
// tile was slower there.
template <typename W>
struct Avx512Tiles : Avx2Tiles<W> {
  __attribute__((target("avx512f"))) static void six(const float* x, int64_t ldx, const W* wp,
                                                    int64_t k0, int64_t k1, float* acc,
                                                    Ahead& ahead) {
    tile_avx512<W, 6>(x, ldx, wp, k0, k1, acc, ahead);
  }
  __attribute__((target("avx512f"))) static void rest(int64_t rows, const float* x, int64_t ldx,
                                                     const W* wp, int64_t k0, int64_t k1,
                                                     float* acc, Ahead& ahead) {
    rest_avx512<W>(rows, x, ldx, wp, k0, k1, acc, ahead);
  }
};

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

// R rows of x times panel rows k0..k1, in k order, multiply then add.
template <typename W>
void rows_portable(int64_t rows, const float* x, int64_t ldx, const W* wp, int64_t k0, int64_t k1,
                   float* acc) {
  for (int64_t r = 0; r < rows; ++r) {
    float* ar = acc + r * kWidth;
    for (int64_t k = k0; k < k1; ++k) {
      const float xk = x[r * ldx + k];
      const W* wk = wp + k * kWidth;
      for (int64_t c = 0; c < kWidth; ++c) ar[c] += xk * to_float(wk[c]);
    }
  }
}

template <typename W>
struct PortableTiles {
  static void first(const float* x, int64_t ldx, const W* wp, int64_t k0, int64_t k1, float* acc) {
    rows_portable(1, x, ldx, wp, k0, k1, acc);
  }
  static void six(const float* x, int64_t ldx, const W* wp, int64_t k0, int64_t k1, float* acc,
                  Ahead&) {
    rows_portable(6, x, ldx, wp, k0, k1, acc);
  }
  static void rest(int64_t rows, const float* x, int64_t ldx, const W* wp, int64_t k0, int64_t k1,
                   float* acc, Ahead&) {
    rows_portable(rows, x, ldx, wp, k0, k1, acc);
  }
};

// ---------------------------------------------------------------------------------------
// One panel, either instruction set's tiles (`Tiles`: `first` is row 0's tile, `six` a group
// of 6 rows, `rest` the last 0 to 5): a function per tile call, each block's worth of work
// (64 k x up to 6 rows x 64 columns) is far more than a call costs.

// Rows 1.. of x times panel rows k0..k1 of `wp` (a panel's weights, indexed from its row 0),
// accumulated into acc ([M, 64]); the tiles ask memory for `ahead` meanwhile.
template <typename W, typename Tiles>
inline void rows_after_first(const Problem& p, const W* wp, int64_t k0, int64_t k1, float* acc,
                             Ahead ahead) {
  int64_t r = 1;
  for (; r + 6 <= p.m; r += 6) Tiles::six(p.x + r * p.k, p.k, wp, k0, k1, acc + r * kWidth, ahead);
  Tiles::rest(p.m - r, p.x + r * p.k, p.k, wp, k0, k1, acc + r * kWidth, ahead);
}

// Every row of x times the block: row 0 first, then the others.
template <typename W, typename Tiles>
inline void block_rows(const Problem& p, const W* wp, int64_t k0, int64_t k1, float* acc,
                       Ahead ahead) {
  // Row 0 reads the block in order, whole rows of the panel (a sequential stream the hardware
  // prefetcher follows); the other rows find it in cache.
  Tiles::first(p.x, p.k, wp, k0, k1, acc);
  rows_after_first<W, Tiles>(p, wp, k0, k1, acc, ahead);
}

inline void store_rows(const Problem& p, int64_t panel, const float* acc) {
  const int64_t c0 = panel * kWidth, cols = std::min(kWidth, p.n - c0);
  for (int64_t r = 0; r < p.m; ++r) std::memcpy(p.y + r * p.n + c0, acc + r * kWidth, cols * 4);
}

template <typename W, typename Tiles>
void panel_blocks(const Problem& p, int64_t panel) {
  const W* wp = static_cast<const W*>(p.w) + panel * p.k * kWidth;
  alignas(64) float acc[kMaxRows * kWidth];
  std::memset(acc, 0, sizeof(float) * p.m * kWidth);
  for (int64_t k0 = 0; k0 < p.k; k0 += kBlockK) {
    const int64_t k1 = std::min(k0 + kBlockK, p.k);
    // The tiles after row 0 ask memory for the next block meanwhile, a group of rows the
    // whole block: left to the hardware, memory would idle while they compute (measured:
    // 20-25% of the time at 4-16 rows). The lines go to the outer caches (prefetcht2), where
    // row 0 finds them: fetched into L1 (prefetcht0) the next block evicts the one the tiles
    // are reading, and 6 to 12 rows took 15-25% longer on a 2-core AVX2 machine.
    const int64_t k2 = std::min(k1 + kBlockK, p.k);
    const Ahead ahead{reinterpret_cast<const char*>(wp + k1 * kWidth),
                      reinterpret_cast<const char*>(wp + k2 * kWidth)};
    block_rows<W, Tiles>(p, wp, k0, k1, acc, ahead);
  }
  store_rows(p, panel, acc);
}

// ---------------------------------------------------------------------------------------
// Block-quantised panels, multiplied as llama.cpp multiplies them on a CPU: integer dot
// products of the weights' 4- or 8-bit values with the rows of x quantised to 8 bits.
//
// GGUF's Q4_1 and Q8_0 quantise each run of 32 weights along K of one output column with its
// own scale d (and, Q4_1, minimum m): w = d q + m with q in 0..15, or w = d q with q in
// -128..127. The loader (pspec_jax.panels.pack_blocks) regroups them into panels: for each 64
// columns and 32 k, one block of
//   Q4_1: d float32[64], m float32[64], then 8 quads (4 k each) of 2 vectors of 64 bytes:
//         vector h, byte 4i + r holds column 32h + i's q at k = 4j + r in its low nibble and
//         column 32h + 16 + i's in its high one (1536 bytes);
//   Q8_0: d float32[64], then 8 quads of 4 vectors of 64 bytes: vector g, byte 4i + r holds
//         column 16g + i's q + 128 at k = 4j + r (2304 bytes).
// A 32-bit lane of a vector is one column's 4 values of a quad: what one VNNI instruction
// (vpdpbusd) multiplies by 4 int8 of x and adds to the column's int32 sum.
//
// A row of x is quantised per 32 k as llama.cpp's Q8_0 / Q8_1 quantise it: dx = max |x| / 127,
// qx = round-to-nearest-even(x / dx) (x times 1 / dx), sx = dx * sum qx. Per block and row the
// sum over the block's 32 k, isum = sum q qx, is an exact integer, and
//   Q4_1: y += (d dx) isum + m sx      Q8_0: y += (d dx) isum
// in that order, each a fused multiply-add (the portable path: std::fma). Every path computes
// these same integers and roundings, so a row's result is the same on every instruction set,
// whichever thread takes its panel and however many rows share the call.

constexpr int64_t kQuantK = 32;  // k per quantisation block
constexpr int64_t kQuads = kQuantK / 4;
constexpr int kGroups = kWidth / 16;  // 16-column vectors of a panel's 64 columns
constexpr int64_t kQ4_1Bytes = 2 * 4 * kWidth + kQuantK * kWidth / 2;
constexpr int64_t kQ8_0Bytes = 4 * kWidth + kQuantK * kWidth;
constexpr int64_t kValueBytes = kQuads * kGroups * 64;  // a block's values, one byte each
constexpr int64_t kAhead = 4;  // quantisation blocks asked for ahead of the one in use

inline const float* block_scales(const uint8_t* block) {
  return reinterpret_cast<const float*>(block);
}

// The rows of x quantised per 32 k (row r, block b at r * k + 32 b, and r * k / 32 + b).
struct QuantRows {
  const int8_t* q;
  const float* d;     // dx
  const int32_t* s;   // sum qx
  const float* sx;    // dx * sum qx
};

using QuantizeFn = void (*)(const float* x, int64_t count, int8_t* q, float* d, int32_t* s,
                            float* sx);  // count: blocks of 32, one after the other

void quantize_portable(const float* x, int64_t count, int8_t* q, float* d, int32_t* s, float* sx) {
  for (int64_t b = 0; b < count; ++b, x += kQuantK, q += kQuantK) {
    float amax = 0.0f;
    for (int64_t i = 0; i < kQuantK; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
    int32_t sum = 0;
    for (int64_t i = 0; i < kQuantK; ++i) {
      q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));  // the rounding mode's: even
      sum += q[i];
    }
    d[b] = db;
    s[b] = sum;
    sx[b] = db * static_cast<float>(sum);
  }
}

// One block's integer sums and their float update, for every row of x: `Dots` is an
// instruction set's (its `rows`); `values` the block's values as stored (Q8_0: 8 x 4 vectors of
// 64 bytes; Q4_1: 8 x 2 vectors of nibbles, which each instruction set unpacks its own way).
struct BlockArgs {
  const float* d;        // the block's scales [64]
  const float* m;        // Q4_1: its minimums [64]; Q8_0: null
  const uint8_t* values;
  int64_t block;         // its index along K
};

// Q4_1's values as one byte each, in Q8_0's order (vector g of quad j at (4j + g) * 64).
void q4_1_values_portable(const uint8_t* v, uint8_t* out) {
  for (int64_t j = 0; j < kQuads; ++j)
    for (int h = 0; h < 2; ++h)
      for (int b = 0; b < 64; ++b) {
        const uint8_t byte = v[(2 * j + h) * 64 + b];
        out[(4 * j + 2 * h) * 64 + b] = byte & 15;
        out[(4 * j + 2 * h + 1) * 64 + b] = byte >> 4;
      }
}

// Row r's float update from its integer sums isum[64] (Q8_0's isum counts q + 128: the 128
// sum qx it adds comes off first).
inline void update_portable(const BlockArgs& a, const QuantRows& x, int64_t nb, int64_t r,
                            const int32_t* isum, float* acc) {
  const int64_t i = r * nb + a.block;
  for (int64_t c = 0; c < kWidth; ++c) {
    const float t = a.d[c] * x.d[i];
    const int32_t sum = a.m != nullptr ? isum[c] : isum[c] - 128 * x.s[i];
    acc[c] = std::fma(t, static_cast<float>(sum), acc[c]);
    if (a.m != nullptr) acc[c] = std::fma(a.m[c], x.sx[i], acc[c]);
  }
}

struct PortableDots {
  static constexpr QuantizeFn quantize = quantize_portable;
  static void rows(BlockArgs a, const QuantRows& x, int64_t m, int64_t k, float* acc) {
    uint8_t values[kValueBytes];
    if (a.m != nullptr) {
      q4_1_values_portable(a.values, values);
      a.values = values;
    }
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* xq = x.q + r * k + a.block * kQuantK;
      int32_t isum[kWidth] = {};
      for (int64_t j = 0; j < kQuads; ++j)
        for (int g = 0; g < kGroups; ++g)
          for (int i = 0; i < 16; ++i)
            for (int e = 0; e < 4; ++e)
              isum[16 * g + i] += a.values[(4 * j + g) * 64 + 4 * i + e] * xq[4 * j + e];
      update_portable(a, x, k / kQuantK, r, isum, acc + r * kWidth);
    }
  }
};

#if PSPEC_X86
// AVX2: no 8-bit dot instruction, so vpmaddubsw (u8 x s8 pairs to int16) and vpmaddwd (pairs
// of int16 to int32). Its int16 pairs saturate past 32767: Q4_1's q <= 15 never does, and Q8_0
// multiplies |q| by qx with q's sign (<= 2 * 128 * 127), which sums q qx directly. Q4_1's pairs
// (|q qx + q' qx'| <= 2 * 15 * 127) add up over a block's 8 quads in int16 (<= 30480), then
// widen once: a third fewer instructions than widening every quad, the same integers.

__attribute__((target("avx2,fma"))) void quantize_avx2(const float* x, int64_t count, int8_t* q,
                                                       float* d, int32_t* s, float* sx) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  // packs interleave the two 128-bit lanes: 32-bit group i of the result is q's group order[i]
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < count; ++b, x += kQuantK, q += kQuantK) {
    __m256 v[4];
    __m256 top = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    t = _mm_max_ss(t, _mm_movehdup_ps(t));
    const float amax = _mm_cvtss_f32(t);
    const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
    const __m256 iv = _mm256_set1_ps(inv);
    __m256i qi[4];
    for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], iv));  // even
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                             _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
    const __m256i all = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                         _mm256_add_epi32(qi[2], qi[3]));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(all), _mm256_extracti128_si256(all, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
    const int32_t sum = _mm_cvtsi128_si32(h);
    d[b] = db;
    s[b] = sum;
    sx[b] = db * static_cast<float>(sum);
  }
}

__attribute__((target("avx2,fma"))) void q4_1_values_avx2(const uint8_t* v, uint8_t* out) {
  const __m256i low = _mm256_set1_epi8(15);
  for (int64_t j = 0; j < kQuads; ++j)
    for (int h = 0; h < 2; ++h)
      for (int half = 0; half < 2; ++half) {
        const __m256i b =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + (2 * j + h) * 64 + 32 * half));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (4 * j + 2 * h) * 64 + 32 * half),
                            _mm256_and_si256(b, low));
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(out + (4 * j + 2 * h + 1) * 64 + 32 * half),
            _mm256_and_si256(_mm256_srli_epi16(b, 4), low));
      }
}

// Q8_0's values as |q| (the first kValueBytes) and q (the next), for rows that share a block:
// each row's pass then takes q's sign alone.
__attribute__((target("avx2,fma"))) void q8_0_values_avx2(const uint8_t* v, uint8_t* out) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t i = 0; i < kValueBytes; i += 32) {
    const __m256i q = _mm256_xor_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i)), flip);  // q + 128 to q
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_abs_epi8(q));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kValueBytes + i), q);
  }
}

__attribute__((target("avx2,fma"))) inline __m256i load(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// How a row's pass finds a block's values: Q4_1's nibbles as stored (unpacked in registers),
// Q4_1's unpacked bytes (`q4_1_values_avx2`), Q8_0's q + 128 as stored, or Q8_0's |q| and q
// (`q8_0_values_avx2`).
enum class Values { kNibbles, kBytes, kStored, kSplit };

template <Values kFrom>
__attribute__((target("avx2,fma"))) void row_avx2(const BlockArgs& a, const QuantRows& x,
                                                  int64_t nb, int64_t r, const int8_t* xq,
                                                  float* acc) {
  constexpr bool kQ4 = kFrom == Values::kNibbles || kFrom == Values::kBytes;
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i low = _mm256_set1_epi8(15);
  __m256i sum[2 * kGroups];  // Q4_1: int16 pairs until the block's end; Q8_0: int32
  for (auto& v : sum) v = _mm256_setzero_si256();
  for (int64_t j = 0; j < kQuads; ++j) {
    int32_t four;
    std::memcpy(&four, xq + 4 * j, 4);
    const __m256i xb = _mm256_set1_epi32(four);
    for (int v = 0; v < 2 * kGroups; ++v) {
      if constexpr (kFrom == Values::kNibbles) {
        // 32-byte half v % 2 of vector g = v / 2: vector g / 2's nibbles
        const int g = v / 2, half = v % 2;
        const __m256i b = load(a.values + (2 * j + g / 2) * 64 + 32 * half);
        const __m256i w = _mm256_and_si256(g % 2 ? _mm256_srli_epi16(b, 4) : b, low);
        sum[v] = _mm256_add_epi16(sum[v], _mm256_maddubs_epi16(w, xb));
      } else if constexpr (kFrom == Values::kBytes) {
        const __m256i w = load(a.values + j * 4 * 64 + 32 * v);
        sum[v] = _mm256_add_epi16(sum[v], _mm256_maddubs_epi16(w, xb));
      } else {
        __m256i magnitude, q;
        if constexpr (kFrom == Values::kStored) {
          q = _mm256_xor_si256(load(a.values + j * 4 * 64 + 32 * v), flip);  // q + 128 to q
          magnitude = _mm256_abs_epi8(q);
        } else {
          magnitude = load(a.values + j * 4 * 64 + 32 * v);
          q = load(a.values + kValueBytes + j * 4 * 64 + 32 * v);
        }
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xb, q));
        sum[v] = _mm256_add_epi32(sum[v], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  const int64_t i = r * nb + a.block;
  const __m256 dx = _mm256_set1_ps(x.d[i]), sx = _mm256_set1_ps(x.sx[i]);
  for (int v = 0; v < 2 * kGroups; ++v) {
    const __m256i isum = kQ4 ? _mm256_madd_epi16(sum[v], ones) : sum[v];
    const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(a.d + 8 * v), dx);
    __m256 y = _mm256_loadu_ps(acc + 8 * v);
    y = _mm256_fmadd_ps(t, _mm256_cvtepi32_ps(isum), y);
    if (kQ4) y = _mm256_fmadd_ps(_mm256_loadu_ps(a.m + 8 * v), sx, y);
    _mm256_storeu_ps(acc + 8 * v, y);
  }
}

struct Avx2Dots {
  static constexpr QuantizeFn quantize = quantize_avx2;
  static void rows(BlockArgs a, const QuantRows& x, int64_t m, int64_t k, float* acc) {
    const int64_t nb = k / kQuantK;
    // One row unpacks in registers: through the buffer, plain decoding of the embedded target
    // took 3.4% longer (Q4_1). Several rows share the buffer's one unpacking.
    if (m == 1) {
      const int8_t* xq = x.q + a.block * kQuantK;
      if (a.m != nullptr) return row_avx2<Values::kNibbles>(a, x, nb, 0, xq, acc);
      return row_avx2<Values::kStored>(a, x, nb, 0, xq, acc);
    }
    alignas(64) uint8_t values[2 * kValueBytes];
    if (a.m != nullptr)
      q4_1_values_avx2(a.values, values);
    else
      q8_0_values_avx2(a.values, values);
    a.values = values;
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* xq = x.q + r * k + a.block * kQuantK;
      if (a.m != nullptr)
        row_avx2<Values::kBytes>(a, x, nb, r, xq, acc + r * kWidth);
      else
        row_avx2<Values::kSplit>(a, x, nb, r, xq, acc + r * kWidth);
    }
  }
};

// AVX-512 VNNI: R rows share each vector of the block's values, 4 int32 sums a row (6 rows:
// 24 sums, 4 values and a broadcast of the 32 registers).

#define PSPEC_VNNI "avx512f,avx512bw,avx512vnni"

__attribute__((target(PSPEC_VNNI))) void quantize_avx512(const float* x, int64_t count, int8_t* q,
                                                         float* d, int32_t* s, float* sx) {
  for (int64_t b = 0; b < count; ++b, x += kQuantK, q += kQuantK) {
    const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
    const __m512 iv = _mm512_set1_ps(inv);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, iv));  // MXCSR's rounding: even
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, iv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
    const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    d[b] = db;
    s[b] = sum;
    sx[b] = db * static_cast<float>(sum);
  }
}

// Row r's float update from its integer sums (`update_portable`'s arithmetic, 16 columns a
// vector).
template <bool kQ4>
__attribute__((target(PSPEC_VNNI), always_inline)) inline void update_avx512(
    const BlockArgs& a, const QuantRows& x, int64_t nb, int64_t r, const __m512i* sum,
    float* acc) {
  const int64_t i = r * nb + a.block;
  const __m512 dx = _mm512_set1_ps(x.d[i]);
  const __m512i off = _mm512_set1_epi32(128 * x.s[i]);
  float* y_r = acc + r * kWidth;
  for (int g = 0; g < kGroups; ++g) {
    const __m512 t = _mm512_mul_ps(_mm512_loadu_ps(a.d + 16 * g), dx);
    const __m512i isum = kQ4 ? sum[g] : _mm512_sub_epi32(sum[g], off);
    __m512 y = _mm512_load_ps(y_r + 16 * g);
    y = _mm512_fmadd_ps(t, _mm512_cvtepi32_ps(isum), y);
    if (kQ4) y = _mm512_fmadd_ps(_mm512_loadu_ps(a.m + 16 * g), _mm512_set1_ps(x.sx[i]), y);
    _mm512_store_ps(y_r + 16 * g, y);
  }
}

// Q4_1's nibbles are unpacked in registers, quad by quad, for every group of rows. Stored to a
// buffer and loaded back instead, they made plain decoding of the embedded target 4% slower,
// and its drafted rounds 1-3%.
template <int R, bool kQ4>
__attribute__((target(PSPEC_VNNI), always_inline)) inline void rows_avx512(
    const BlockArgs& a, const QuantRows& x, int64_t k, int64_t r0, float* acc) {
  const int64_t nb = k / kQuantK;
  __m512i sum[R][kGroups];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < kGroups; ++g) sum[r][g] = _mm512_setzero_si512();
  const int8_t* xq = x.q + r0 * k + a.block * kQuantK;
  const __m512i low = _mm512_set1_epi8(15);
  for (int64_t j = 0; j < kQuads; ++j) {
    __m512i w[kGroups];
    if constexpr (kQ4) {  // vector h of quad j: the low nibbles are w[2h], the high ones w[2h + 1]
      for (int h = 0; h < 2; ++h) {
        const __m512i b = _mm512_loadu_si512(a.values + (2 * j + h) * 64);
        w[2 * h] = _mm512_and_si512(b, low);
        w[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
      }
    } else {
      for (int g = 0; g < kGroups; ++g) w[g] = _mm512_loadu_si512(a.values + (4 * j + g) * 64);
    }
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, xq + r * k + 4 * j, 4);
      const __m512i xb = _mm512_set1_epi32(four);
      for (int g = 0; g < kGroups; ++g) sum[r][g] = _mm512_dpbusd_epi32(sum[r][g], w[g], xb);
    }
  }
  for (int r = 0; r < R; ++r) update_avx512<kQ4>(a, x, nb, r0 + r, sum[r], acc);
}

struct Avx512Dots {
  static constexpr QuantizeFn quantize = quantize_avx512;
  __attribute__((target(PSPEC_VNNI))) static void rows(const BlockArgs& a, const QuantRows& x,
                                                       int64_t m, int64_t k, float* acc) {
    if (a.m != nullptr)
      rows_of<true>(a, x, m, k, acc);
    else
      rows_of<false>(a, x, m, k, acc);
  }
  template <bool kQ4>
  __attribute__((target(PSPEC_VNNI))) static void rows_of(const BlockArgs& a, const QuantRows& x,
                                                          int64_t m, int64_t k, float* acc) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) rows_avx512<4, kQ4>(a, x, k, r, acc);
    switch (m - r) {
      case 1: return rows_avx512<1, kQ4>(a, x, k, r, acc);
      case 2: return rows_avx512<2, kQ4>(a, x, k, r, acc);
      case 3: return rows_avx512<3, kQ4>(a, x, k, r, acc);
    }
  }
};

// AMX (Intel Xeon from Sapphire Rapids on): one tile instruction multiplies up to 16 rows of x
// by a block's 16 columns, all 32 k (tdpbsud: x's int8 by the values' uint8, int32 sums), where
// VNNI needs 8 instructions a row. The sums are the same exact integers, stored to memory and
// updated as on AVX-512, so the bits are too. Tile 0: the rows' 32 bytes of the block; 1 and 2:
// a group of 16 columns' 8 quads of 64 bytes (Q4_1's unpacked to bytes first); 4 to 7: the rows'
// sums of the four groups. A block's tile instructions wait on one another (load, multiply,
// store, update), so below `kAmxMinRows` rows VNNI's registers are faster: on a 2-core Xeon
// (Emerald Rapids, one kernel thread) the embedded target's products took 1.18x VNNI's time at
// 4 rows, 1.07x at 8, 0.96x at 9, 0.87x at 12 and 0.82x at 16. Above a tile's 16 rows (a
// prefill) VNNI runs too.

#define PSPEC_AMX "amx-tile,amx-int8," PSPEC_VNNI

constexpr int64_t kAmxMinRows = 9;
constexpr int64_t kAmxMaxRows = 16;

// Whether the CPU has AMX's int8 tiles and the OS lets this process use them (Linux grants
// their state to a process that asks, once, for all its threads).
bool amx_usable() {
#if defined(__linux__)
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 24)) || !(d & (1u << 25))) return false;  // AMX-TILE, AMX-INT8
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
#else
  return false;
#endif
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles are per thread: each panel task configures them for its m rows and releases them.
// GCC's `_tile_loadconfig` and `_tile_loadd` do not tell the compiler they read memory (the
// config's first 8 bytes at most), which could then drop or move the stores they read; these
// do.
__attribute__((target(PSPEC_AMX))) void amx_configure(int64_t m) {
  TileConfig c{};
  c.palette = 1;
  c.rows[0] = static_cast<uint8_t>(m);
  c.colsb[0] = kQuantK;
  for (int t = 1; t < 3; ++t) c.rows[t] = kQuads, c.colsb[t] = 64;
  for (int t = 4; t < 8; ++t) c.rows[t] = static_cast<uint8_t>(m), c.colsb[t] = 64;
  __asm__ volatile("ldtilecfg %0" ::"m"(c) : "memory");
}

#define PSPEC_TILE_LOAD(tile, base, stride)                                                  \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #tile ::"r"(static_cast<const void*>(base)), \
                   "r"(static_cast<long>(stride))                                            \
                   : "memory")

struct AmxDots {
  static constexpr QuantizeFn quantize = quantize_avx512;
  __attribute__((target(PSPEC_AMX))) static void rows(const BlockArgs& a, const QuantRows& x,
                                                     int64_t m, int64_t k, float* acc) {
    if (a.m != nullptr)
      rows_of<true>(a, x, m, k, acc);
    else
      rows_of<false>(a, x, m, k, acc);
  }
  template <bool kQ4>
  __attribute__((target(PSPEC_AMX))) static void rows_of(const BlockArgs& a, const QuantRows& x,
                                                         int64_t m, int64_t k, float* acc) {
    alignas(64) uint8_t bytes[kValueBytes];
    alignas(64) int32_t sums[kAmxMaxRows * kWidth];
    const uint8_t* values = a.values;
    if constexpr (kQ4) {  // Q8_0's order: vector g of quad j at (4j + g) * 64
      const __m512i low = _mm512_set1_epi8(15);
      for (int64_t j = 0; j < kQuads; ++j)
        for (int h = 0; h < 2; ++h) {
          const __m512i v = _mm512_loadu_si512(values + (2 * j + h) * 64);
          _mm512_store_si512(bytes + (4 * j + 2 * h) * 64, _mm512_and_si512(v, low));
          _mm512_store_si512(bytes + (4 * j + 2 * h + 1) * 64,
                             _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
      values = bytes;
    }
    constexpr int64_t quad = kGroups * 64;  // from a group's quad to its next
    constexpr int64_t row = kWidth * sizeof(int32_t);
    PSPEC_TILE_LOAD(0, x.q + a.block * kQuantK, k);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    PSPEC_TILE_LOAD(1, values, quad);
    _tile_dpbsud(4, 0, 1);
    PSPEC_TILE_LOAD(2, values + 64, quad);
    _tile_dpbsud(5, 0, 2);
    PSPEC_TILE_LOAD(1, values + 128, quad);
    _tile_dpbsud(6, 0, 1);
    PSPEC_TILE_LOAD(2, values + 192, quad);
    _tile_dpbsud(7, 0, 2);
    _tile_stored(4, sums, row);
    _tile_stored(5, sums + 16, row);
    _tile_stored(6, sums + 32, row);
    _tile_stored(7, sums + 48, row);
    for (int64_t r = 0; r < m; ++r) {
      __m512i sum[kGroups];
      for (int g = 0; g < kGroups; ++g) sum[g] = _mm512_load_si512(sums + r * kWidth + 16 * g);
      update_avx512<kQ4>(a, x, k / kQuantK, r, sum, acc);
    }
  }
};
#endif  // PSPEC_X86

// A block-quantised panel: block by block along K, every row's integer sums and update.
template <bool kQ4, typename Dots>
void panel_quantised(const Problem& p, int64_t panel) {
  constexpr int64_t bytes = kQ4 ? kQ4_1Bytes : kQ8_0Bytes;
  const int64_t nb = p.k / kQuantK;
  const uint8_t* blocks = static_cast<const uint8_t*>(p.w) + panel * nb * bytes;
  const uint8_t* end = blocks + nb * bytes;
  alignas(64) float acc[kMaxRows * kWidth];
  std::memset(acc, 0, sizeof(float) * p.m * kWidth);
  // Ask memory for the panel's first kAhead blocks at once, then for the block kAhead on
  // before each: a panel's stream (18-48 blocks) is too short for the hardware prefetcher to
  // reach full speed.
  auto prefetch = [end](const uint8_t* from, const uint8_t* to) {
    for (const uint8_t* line = from; line < std::min(to, end); line += 64)
      __builtin_prefetch(line, 0, 3);
  };
  prefetch(blocks, blocks + kAhead * bytes);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* src = blocks + b * bytes;
    prefetch(src + kAhead * bytes, src + (kAhead + 1) * bytes);
    const float* scales = block_scales(src);
    const BlockArgs a{scales, kQ4 ? scales + kWidth : nullptr, src + (kQ4 ? 2 : 1) * 4 * kWidth, b};
    Dots::rows(a, *p.quant, p.m, p.k, acc);
  }
  store_rows(p, panel, acc);
}

#if PSPEC_X86
template <bool kQ4>
__attribute__((target(PSPEC_AMX))) void panel_quantised_amx(const Problem& p, int64_t panel) {
  if (p.m < kAmxMinRows || p.m > kAmxMaxRows) return panel_quantised<kQ4, Avx512Dots>(p, panel);
  amx_configure(p.m);
  panel_quantised<kQ4, AmxDots>(p, panel);
  _tile_release();
}
#endif

// ---------------------------------------------------------------------------------------
// Which code runs: AVX-512 where the CPU has it, else AVX2 + FMA, else portable (block-quantised
// panels: AMX's tiles for 9 to 16 rows where the CPU and OS allow them, else AVX-512 with VNNI,
// else the AVX2 path); PSPEC_JAX_CPU_KERNEL_ISA (avx512 | avx2 | portable) holds it below that
// (the tests run each).

using PanelFn = void (*)(const Problem&, int64_t);

struct Isa {
  PanelFn f32, bf16, q4_1, q8_0;
  QuantizeFn quantize;
  const char* name;
};

template <template <typename> class Tiles, typename Dots>
constexpr Isa isa_of(const char* name) {
  return {panel_blocks<float, Tiles<float>>, panel_blocks<uint16_t, Tiles<uint16_t>>,
          panel_quantised<true, Dots>, panel_quantised<false, Dots>, Dots::quantize, name};
}

Isa choose_isa() {
#if PSPEC_X86
  const char* want = std::getenv("PSPEC_JAX_CPU_KERNEL_ISA");
  const bool portable = want != nullptr && std::strcmp(want, "portable") == 0;
  const bool at_most_avx2 = portable || (want != nullptr && std::strcmp(want, "avx2") == 0);
  const bool at_most_avx512 = at_most_avx2 || (want != nullptr && std::strcmp(want, "avx512") == 0);
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2 && !at_most_avx2 && __builtin_cpu_supports("avx512f")) {
    const bool vnni =
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
    if (!vnni) return isa_of<Avx512Tiles, Avx2Dots>("avx512");
    Isa chosen = isa_of<Avx512Tiles, Avx512Dots>("avx512");
    if (!at_most_avx512 && amx_usable()) {
      chosen.q4_1 = panel_quantised_amx<true>;
      chosen.q8_0 = panel_quantised_amx<false>;
      chosen.name = "avx512+amx";
    }
    return chosen;
  }
  if (avx2 && !portable) return isa_of<Avx2Tiles, Avx2Dots>("avx2");
#endif
  return isa_of<PortableTiles, PortableDots>("portable");
}

const Isa& isa() {
  static const Isa chosen = choose_isa();
  return chosen;
}

// ---------------------------------------------------------------------------------------
// The pool. A job is `count` tasks, task i being fn(ctx, i). `next` packs the call's generation
// (high 32 bits), its number of tasks (16 bits) and the next task to take (low 16 bits). A
// thread takes a task only with a compare-and-swap that sees the generation it read the call
// under and a task left to take, so it never reads the job of a call that is not published
// yet: a late worker can neither take a task of a later call nor see a job half written.

struct Job {
  void (*fn)(const void* ctx, int64_t i);
  const void* ctx;
  int64_t count;
};

constexpr int64_t kMaxTasks = 0xffff;  // more tasks than this: the caller runs them alone

// Memory the idle workers ask for between calls (`Pool::read_ahead`): up to kMaxRegions
// ranges of bytes, read in the order given.
constexpr int kMaxRegions = 4;
struct Regions {
  std::atomic<const char*> from[kMaxRegions];
  std::atomic<int64_t> bytes[kMaxRegions];
  Regions() {
    for (auto& f : from) f.store(nullptr, std::memory_order_relaxed);
    for (auto& b : bytes) b.store(0, std::memory_order_relaxed);
  }
};

inline void pause() {
#if PSPEC_X86
  _mm_pause();
#endif
}

// Waiting for another thread: `kSpins` pauses (tens of microseconds: what a task of a quiet
// machine's call takes), then a `sched_yield` at each look. With a core to itself a yield
// returns at once; on a busy machine it lets the thread waited for run.
class Backoff {
 public:
  void wait() {
    if (spins_ < kSpins) {
      ++spins_;
      pause();
    } else {
      sched_yield();
    }
  }

 private:
  static constexpr int kSpins = 1024;
  int spins_ = 0;
};

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

  void run(const Job& job) {
    // Calls from two XLA threads at once: the second computes alone, the cores are busy.
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || workers_.empty() || job.count < 2 || job.count > kMaxTasks) {
      for (int64_t i = 0; i < job.count; ++i) job.fn(job.ctx, i);
      return;
    }
    // No thread reads job_ now: the last call's tasks are all taken and done.
    job_ = job;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (next_.load(std::memory_order_relaxed) >> 32) + 1;
    next_.store(gen << 32 | static_cast<uint64_t>(job.count) << 16, std::memory_order_release);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    take_tasks(gen);
    for (Backoff backoff; done_.load(std::memory_order_acquire) < job.count;) backoff.wait();
  }

  // Idle workers ask memory for `regions` (null: nothing) until the next call, a few lines at
  // a time: what the caller expects its next call to read, so that it waits in cache, not in
  // memory, when the call comes. Only a hint: the memory may have gone since (a prefetch never
  // faults), and a call that reads something else is merely not helped.
  void read_ahead(const Regions* regions) {
    ahead_.store(regions, std::memory_order_relaxed);
    ahead_serial_.fetch_add(1, std::memory_order_release);
  }

 private:
  void take_tasks(uint64_t gen) {
    uint64_t v = next_.load(std::memory_order_acquire);
    while (true) {
      if ((v >> 32) != gen) return;
      const int64_t count = static_cast<int64_t>((v >> 16) & 0xffffu);
      const int64_t i = static_cast<int64_t>(v & 0xffffu);
      if (i >= count) return;
      if (!next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) continue;
      job_.fn(job_.ctx, i);
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
        take_tasks(gen);
        continue;
      }
      // Spin for about 200 microseconds, asking memory for what the next call reads, then
      // sleep until the next call.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
      bool woke = false;
      for (Backoff backoff; !woke && std::chrono::steady_clock::now() < until;) {
        if (!read_some_ahead()) backoff.wait();
        woke = (next_.load(std::memory_order_acquire) >> 32) != seen || stop_.load();
      }
      if (woke) continue;
      std::unique_lock<std::mutex> lock(mu_);
      sleepers_.fetch_add(1);
      cv_.wait(lock, [&] { return (next_.load() >> 32) != seen || stop_.load(); });
      sleepers_.fetch_sub(1);
    }
  }

  // A few lines of `ahead_`'s regions past this worker's cursor (reset when the caller
  // names new regions); false once they are all asked for.
  bool read_some_ahead() {
    thread_local uint64_t serial = 0;
    thread_local int region = 0;
    thread_local int64_t offset = 0;
    const uint64_t now = ahead_serial_.load(std::memory_order_acquire);
    if (now != serial) serial = now, region = 0, offset = 0;
    const Regions* r = ahead_.load(std::memory_order_relaxed);
    if (r == nullptr) return false;
    for (; region < kMaxRegions; ++region, offset = 0) {
      const char* from = r->from[region].load(std::memory_order_relaxed);
      const int64_t bytes = r->bytes[region].load(std::memory_order_relaxed);
      if (from == nullptr || offset >= bytes) continue;
      const int64_t end = std::min(bytes, offset + kAheadStep);
      for (; offset < end; offset += 64) __builtin_prefetch(from + offset, 0, 2);
      return true;
    }
    return false;
  }

  static constexpr int64_t kAheadStep = 2048;  // bytes asked for between looks at the next call

  std::vector<std::thread> workers_;
  std::atomic<const Regions*> ahead_{nullptr};
  std::atomic<uint64_t> ahead_serial_{0};
  std::atomic<uint64_t> next_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex busy_, mu_;
  std::condition_variable cv_;
  Job job_{};
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

// Several weights multiply the same rows in one call (a layer's q, k and v, or its gate and up
// projections): one pool job over all their panels, so the threads synchronise once and share
// the panels of every weight (k and v alone have 3 panels each, for 2 threads).
constexpr int64_t kMaxWeights = 4;
static_assert(kMaxWeights <= kMaxRegions);

// Read-ahead of the next call's weights. A decoding step makes the same calls in the same
// order every time (a layer's q/k/v, o, gate/up, down, the next layer's q/k/v, ...), with the
// norms, rotary embeddings and attention between them, during which memory would stand idle.
// Each calling thread remembers which call followed each call (by its first weight) the last
// time, and while XLA computes what lies between, the idle workers ask memory for the start
// of that call's weights, up to `read_ahead_bytes`: by default what a core's L2 holds (on a
// 2-core AMD EPYC, Zen 5 with 1 MB of L2, 2 MB once made a step slower than 1 MB, and 1 MB made
// plain decoding's steps 0.87-0.93x and a drafted round's 0.86-0.94x what they took without),
// or PSPEC_JAX_CPU_KERNEL_READ_AHEAD bytes (0: none).
int64_t default_read_ahead() {
  if (const char* s = std::getenv("PSPEC_JAX_CPU_KERNEL_READ_AHEAD")) {
    char* end = nullptr;
    const long long bytes = std::strtoll(s, &end, 10);
    if (end != s && *end == '\0' && bytes >= 0) return bytes;
  }
  int64_t l2 = 0;
#if defined(_SC_LEVEL2_CACHE_SIZE)
  l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
  return l2 > 0 ? std::clamp<int64_t>(l2, int64_t{256} << 10, int64_t{2} << 20) : int64_t{1} << 20;
}

std::atomic<int64_t> read_ahead_bytes{default_read_ahead()};
constexpr size_t kMaxRemembered = 4096;  // calls remembered per thread (several models' steps)

// The Regions the call after this one read last time (null: none yet), after noting that the
// call before this one was followed by this one (`weights`, the call's weights and their bytes;
// a call is known by its first weight).
const Regions* remember_calls(const char* const* weights, const int64_t* bytes, int64_t count) {
  const void* key = weights[0];
  // Never freed, never shrunk: a worker may be reading an entry (after a thread's end too).
  thread_local auto& next_of = *new std::unordered_map<const void*, Regions>();
  thread_local const void* last = nullptr;
  const bool room = next_of.size() < kMaxRemembered || next_of.count(last) > 0;
  if (last != nullptr && last != key && room) {
    Regions& r = next_of[last];
    int64_t left = read_ahead_bytes.load(std::memory_order_relaxed);
    for (int j = 0; j < kMaxRegions; ++j) {
      const int64_t take = j < count ? std::min(bytes[j], left) : 0;
      r.from[j].store(j < count ? weights[j] : nullptr, std::memory_order_relaxed);
      r.bytes[j].store(take, std::memory_order_relaxed);
      left -= take;
    }
  }
  last = key;
  const auto it = next_of.find(key);
  return it == next_of.end() ? nullptr : &it->second;
}

ffi::Error PanelMatmulImpl(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws, ffi::RemainingRets ys) {
  const auto xd = x.dimensions();
  const int64_t count = static_cast<int64_t>(ws.size());
  if (xd.size() != 2 || count < 1 || count > kMaxWeights || ys.size() != ws.size()) {
    return ffi::Error::InvalidArgument("panel_matmul: x [M, K], 1 to 4 weights, as many results");
  }
  const int64_t m = xd[0], k = xd[1];
  if (m > kMaxRows) return ffi::Error::InvalidArgument("panel_matmul: too many rows");
  struct Panels {
    Problem p[kMaxWeights];
    PanelFn fn[kMaxWeights];
    int64_t start[kMaxWeights + 1];  // weight j's panels are tasks start[j]..start[j + 1] - 1
  } ctx{};
  QuantRows quant{};
  bool quantised = false;
  const char* weights[kMaxWeights] = {};
  int64_t weight_bytes[kMaxWeights] = {};
  for (int64_t j = 0; j < count; ++j) {
    auto w = ws.get<ffi::AnyBuffer>(j);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(j);
    if (!w.has_value() || !y.has_value()) {
      return ffi::Error::InvalidArgument("panel_matmul: weights are arrays, results float32");
    }
    const auto wd = w->dimensions(), yd = (*y)->dimensions();
    if (wd.size() != 3 || yd.size() != 2) {
      return ffi::Error::InvalidArgument("panel_matmul: W [P, K, 64] or [P, K / 32, B], y [M, N]");
    }
    const auto type = w->element_type();
    PanelFn fn = nullptr;
    int64_t wk = wd[1];  // the weight's K
    if (type == ffi::DataType::F32 && wd[2] == kWidth) {
      fn = isa().f32;
    } else if (type == ffi::DataType::BF16 && wd[2] == kWidth) {
      fn = isa().bf16;
    } else if (type == ffi::DataType::U8 && (wd[2] == kQ4_1Bytes || wd[2] == kQ8_0Bytes)) {
      fn = wd[2] == kQ4_1Bytes ? isa().q4_1 : isa().q8_0;
      wk = wd[1] * kQuantK;
    } else {
      return ffi::Error::InvalidArgument(
          "panel_matmul: W must be float32 or bfloat16 [P, K, 64], or uint8 Q4_1 or Q8_0 "
          "blocks [P, K / 32, 1536 or 2304]");
    }
    const int64_t n = yd[1], panels = wd[0];
    if (wk != k || yd[0] != m || n > panels * kWidth) {
      return ffi::Error::InvalidArgument("panel_matmul: shapes do not match");
    }
    ctx.p[j] = {x.typed_data(), w->untyped_data(), (*y)->typed_data(), m, k, n, panels, &quant};
    ctx.fn[j] = fn;
    ctx.start[j + 1] = ctx.start[j] + panels;
    weights[j] = static_cast<const char*>(w->untyped_data());
    weight_bytes[j] = static_cast<int64_t>(w->size_bytes());
    quantised = quantised || type == ffi::DataType::U8;
  }
  if (quantised) {  // once per call, for every weight and thread (this thread's buffers)
    thread_local std::vector<int8_t> q;
    thread_local std::vector<float> d, sx;
    thread_local std::vector<int32_t> s;
    const int64_t count = m * k / kQuantK;
    q.resize(m * k);
    d.resize(count);
    sx.resize(count);
    s.resize(count);
    isa().quantize(x.typed_data(), count, q.data(), d.data(), s.data(), sx.data());
    quant = {q.data(), d.data(), s.data(), sx.data()};
  }
  auto one = [](const void* c, int64_t i) {
    const auto& job = *static_cast<const Panels*>(c);
    int64_t j = 0;
    while (i >= job.start[j + 1]) ++j;
    job.fn[j](job.p[j], i - job.start[j]);
  };
  // Published before the call: a worker reads ahead only once it has no task of it left.
  pool().read_ahead(remember_calls(weights, weight_bytes, count));
  pool().run({one, &ctx, ctx.start[count]});
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------
// DecodeAttention: softmax(q k^T * scale) v for the T new tokens of one layer, over the key/value
// cache (slots below the sequence's length) and the new tokens (where `mask` allows), in one
// pass over the cache: XLA's batched dots read it several times, in small pieces.
//
//   q [B, T, KV, G, H], caches [B, S, KV, H], cache_len [B] int32, new keys/values [B, T, KV, H],
//   mask [B, T, T] bool (new token t sees new token u), out [B, T, KV, G, H]; all float32.
//
// A row first lists the keys it sees, in slot order: the cache's first `len` slots, then the new
// tokens its mask allows. Scores, softmax and the weighted sum run over that list alone (the sum
// normalised once at the end), and a key's score is computed the same way wherever it sits in
// the list. So a row's result depends on nothing but the keys and values it sees, in that order,
// never on the other rows of the call or on slots it does not see: a verified tree node, whose
// ancestors are new tokens, computes bit for bit what a plain step computes with them in the
// cache. On AVX-512 a task is a block of up to kBlockRows rows of one (sequence, key/value head),
// which read each cached key and value once for the block; elsewhere a task is one (sequence,
// query head)'s T rows, one after another. A row that sees nothing at all
// (padding) averages every slot's value, as a softmax of equal masked scores does.

struct RowOps {
  // out[j] = (q . keys[j]) * scale, j < n: each dot product in one fixed order, whatever j is.
  void (*scores)(const float* q, const float* const* keys, int64_t n, int64_t h, float scale,
                 float* out);
  // w[j] = exp(w[j] - max w), j < n; returns their sum.
  float (*softmax)(float* w, int64_t n);
  // out = (sum_j w[j] * values[j]) / total over j < n (h floats).
  void (*values)(const float* w, const float* const* values, int64_t n, int64_t h, float total,
                 float* out);
};

#if PSPEC_X86
// exp on 8 lanes (Cephes' expf: 2^n e^r with a degree-5 polynomial; relative error ~2e-7).
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.37626f));
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

// AVX-512 attention runs a block of up to kBlockRows rows of one key/value head together, so
// each key and value is read from memory once per block, not once per row.
constexpr int kBlockRows = 6;

// 16 keys' scores against q: each key's products in one vector (q's first 16 floats times the
// key's, then one fused step per further 16, in order), the 16 keys side by side, then the 16
// vectors summed across lanes by one network (4 levels of shuffles and adds) that treats every
// key alike, so a key's score does not depend on its place among the 16. Lane j: key j.
__attribute__((target("avx512f"), always_inline)) inline __m512 scores16(const float* q,
                                                                         const float* const* key,
                                                                         int64_t h) {
  __m512 a[16];
  const __m512 q0 = _mm512_loadu_ps(q);
  for (int j = 0; j < 16; ++j) a[j] = _mm512_mul_ps(q0, _mm512_loadu_ps(key[j]));
  for (int64_t i = 16; i < h; i += 16) {
    const __m512 qi = _mm512_loadu_ps(q + i);
    for (int j = 0; j < 16; ++j) a[j] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(key[j] + i), a[j]);
  }
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // per key: lane l + lane l + 8
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // + lanes 4 apart: one key per 128-bit quarter
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // + lanes 2 apart
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88),  // + the neighbour
                                 _mm512_shuffle_ps(d[0], d[1], 0xDD));
  // Lane 4a + b of the network's result holds key a + 4b: put key j in lane j.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}

// out_r[j] = (q_r . keys[j]) * scale for the block's rows r, keys j < n: 16 keys at a time, read
// once for every row (short groups padded with a key of zeros).
__attribute__((target("avx512f"))) void scores_avx512(const float* const* q, int rows,
                                                      const float* const* keys, int64_t n,
                                                      int64_t h, float scale, float* const* out,
                                                      const float* zero) {
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const float* key[16];
    for (int j = 0; j < 16; ++j) key[j] = j0 + j < n ? keys[j0 + j] : zero;
    const int64_t count = std::min<int64_t>(16, n - j0);
    for (int r = 0; r < rows; ++r)
      _mm512_mask_storeu_ps(out[r] + j0, static_cast<__mmask16>((1u << count) - 1),
                            _mm512_mul_ps(scores16(q[r], key, h), scale16));
  }
}

// acc_r += sum_j w_r[j] * values[j], j < n in order, for R rows (one running sum per row and
// 16 columns), V vectors of 16 columns from column c: each value is read once for every row.
template <int R, int V>
__attribute__((target("avx512f"), always_inline)) inline void values_columns(
    const float* const* w, const float* const* values, int64_t n, int64_t c,
    float* const* acc) {
  __m512 sum[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) sum[r][v] = _mm512_loadu_ps(acc[r] + c + 16 * v);
  for (int64_t j = 0; j < n; ++j) {
    __m512 value[V];
    for (int v = 0; v < V; ++v) value[v] = _mm512_loadu_ps(values[j] + c + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(w[r][j]);
      for (int v = 0; v < V; ++v) sum[r][v] = _mm512_fmadd_ps(p, value[v], sum[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc[r] + c + 16 * v, sum[r][v]);
}

template <int R>
__attribute__((target("avx512f"))) void values_rows(const float* const* w,
                                                    const float* const* values, int64_t n,
                                                    int64_t h, float* const* acc) {
  int64_t c = 0;
  for (; c + 64 <= h; c += 64) values_columns<R, 4>(w, values, n, c, acc);
  for (; c < h; c += 16) values_columns<R, 1>(w, values, n, c, acc);  // h % 16 == 0
}

__attribute__((target("avx512f"))) void values_avx512(const float* const* w, int rows,
                                                      const float* const* values, int64_t n,
                                                      int64_t h, float* const* acc) {
  static_assert(kBlockRows == 6, "a case per block size below");
  switch (rows) {
    case 1: return values_rows<1>(w, values, n, h, acc);
    case 2: return values_rows<2>(w, values, n, h, acc);
    case 3: return values_rows<3>(w, values, n, h, acc);
    case 4: return values_rows<4>(w, values, n, h, acc);
    case 5: return values_rows<5>(w, values, n, h, acc);
    case 6: return values_rows<6>(w, values, n, h, acc);
  }
}

// The max, exp8 on each half and the sum, 16 at a time; the sum's lanes run over list positions,
// then across lanes.
__attribute__((target("avx512f,avx2,fma"))) float softmax_avx512(float* w, int64_t n) {
  const auto mask = [n](int64_t j) {
    return static_cast<__mmask16>(j + 16 <= n ? 0xffffu : (1u << (n - j)) - 1);
  };
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16)
    top = _mm512_mask_max_ps(top, mask(j), top, _mm512_maskz_loadu_ps(mask(j), w + j));
  const __m256 shift = _mm256_set1_ps(_mm512_reduce_max_ps(top));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    // The halves split and rejoin through double casts, which need no AVX-512DQ.
    const __m512d x = _mm512_castps_pd(_mm512_maskz_loadu_ps(mask(j), w + j));
    const __m256 lo = exp8(_mm256_sub_ps(_mm256_castpd_ps(_mm512_castpd512_pd256(x)), shift));
    const __m256 hi = exp8(_mm256_sub_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(x, 1)), shift));
    const __m512 e = _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
    _mm512_mask_storeu_ps(w + j, mask(j), e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask(j), e));
  }
  return _mm512_reduce_add_ps(sum);
}

__attribute__((target("avx2,fma"))) void scores_avx2(const float* q, const float* const* keys,
                                                      int64_t n, int64_t h, float scale,
                                                      float* out) {
  for (int64_t j = 0; j < n; ++j) {
    const float* key = keys[j];
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= h; i += 16) {
      even = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(key + i), even);
      odd = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(key + i + 8), odd);
    }
    if (i < h) even = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(key + i), even);
    const __m256 sum8 = _mm256_add_ps(even, odd);
    const __m128 sum4 = _mm_add_ps(_mm256_castps256_ps128(sum8), _mm256_extractf128_ps(sum8, 1));
    const __m128 sum2 = _mm_add_ps(sum4, _mm_movehl_ps(sum4, sum4));
    const __m128 sum1 = _mm_add_ss(sum2, _mm_movehdup_ps(sum2));
    out[j] = _mm_cvtss_f32(sum1) * scale;
  }
}

__attribute__((target("avx2,fma"))) void values_avx2(const float* w, const float* const* values,
                                                    int64_t n, int64_t h, float total,
                                                    float* out) {
  const __m256 total8 = _mm256_set1_ps(total);
  for (int64_t c = 0; c < h; c += 32) {  // 4 accumulators of 8 columns (h % 8 == 0)
    const int vectors = static_cast<int>(std::min<int64_t>(32, h - c) / 8);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int64_t j = 0; j < n; ++j) {
      const __m256 p = _mm256_set1_ps(w[j]);
      const float* value = values[j] + c;
      for (int v = 0; v < vectors; ++v)
        acc[v] = _mm256_fmadd_ps(p, _mm256_loadu_ps(value + 8 * v), acc[v]);
    }
    for (int v = 0; v < vectors; ++v)
      _mm256_storeu_ps(out + c + 8 * v, _mm256_div_ps(acc[v], total8));
  }
}

__attribute__((target("avx2,fma"))) void exp_shifted_avx2(float* w, int64_t n, float top) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(w + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(w + j), _mm256_set1_ps(top))));
  if (j < n) {  // the last few through a padded vector: the same arithmetic per element
    alignas(32) float tail[8] = {};
    std::copy(w + j, w + n, tail);
    exp_shifted_avx2(tail, 8, top);
    std::copy(tail, tail + (n - j), w + j);
  }
}

__attribute__((target("avx2,fma"))) float softmax_avx2(float* w, int64_t n) {
  exp_shifted_avx2(w, n, *std::max_element(w, w + n));
  float total = 0;
  for (int64_t j = 0; j < n; ++j) total += w[j];
  return total;
}
#endif

void scores_portable(const float* q, const float* const* keys, int64_t n, int64_t h,
                     float scale, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    float acc = 0;
    for (int64_t i = 0; i < h; ++i) acc += q[i] * keys[j][i];
    out[j] = acc * scale;
  }
}

float softmax_portable(float* w, int64_t n) {
  const float top = *std::max_element(w, w + n);
  float total = 0;
  for (int64_t j = 0; j < n; ++j) total += w[j] = std::exp(w[j] - top);
  return total;
}

void values_portable(const float* w, const float* const* values, int64_t n, int64_t h,
                     float total, float* out) {
  std::fill_n(out, h, 0.0f);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < h; ++c) out[c] += w[j] * values[j][c];
  for (int64_t c = 0; c < h; ++c) out[c] /= total;
}

RowOps row_ops(int64_t h) {
#if PSPEC_X86
  if (std::strcmp(isa().name, "portable") != 0 && h % 8 == 0)
    return {scores_avx2, softmax_avx2, values_avx2};
#endif
  return {scores_portable, softmax_portable, values_portable};
}

struct Attention {
  const float *q, *k_cache, *v_cache, *k_new, *v_new;
  const int32_t* cache_len;
  const bool* mask;
  float* out;
  int64_t b, t, s, kv, g, h;
  float scale;
  RowOps ops;  // row_ops(h), chosen once per call

  int64_t stride() const { return kv * h; }  // between a head's rows of consecutive slots
  int64_t cache_len_of(int64_t bi) const { return std::clamp<int64_t>(cache_len[bi], 0, s); }
  const float* key(int64_t bi, int64_t head, int64_t slot) const {
    return k_cache + ((bi * s + slot) * kv + head) * h;
  }
  const float* value(int64_t bi, int64_t head, int64_t slot) const {
    return v_cache + ((bi * s + slot) * kv + head) * h;
  }
  const float* new_key(int64_t bi, int64_t head, int64_t u) const {
    return k_new + ((bi * t + u) * kv + head) * h;
  }
  const float* new_value(int64_t bi, int64_t head, int64_t u) const {
    return v_new + ((bi * t + u) * kv + head) * h;
  }
  int64_t row(int64_t bi, int64_t tok, int64_t head, int64_t grp) const {
    return ((bi * t + tok) * kv + head) * g + grp;
  }
  // The new tokens row `tok` sees, appended to keys/values from `n` on; returns the new count.
  int64_t add_new(int64_t bi, int64_t head, int64_t tok, const float** keys,
                  const float** values, int64_t n) const {
    const bool* sees = mask + (bi * t + tok) * t;
    for (int64_t u = 0; u < t; ++u) {
      if (!sees[u]) continue;
      keys[n] = new_key(bi, head, u);
      values[n++] = new_value(bi, head, u);
    }
    return n;
  }
  // A row that sees nothing (padding) averages every slot: all values, each weight 1.
  int64_t add_every_slot(int64_t bi, int64_t head, const float** values, float* w) const {
    int64_t n = 0;
    for (int64_t j = 0; j < s; ++j) values[n++] = value(bi, head, j);
    for (int64_t u = 0; u < t; ++u) values[n++] = new_value(bi, head, u);
    std::fill_n(w, n, 1.0f);
    return n;
  }
};

// One (sequence, query head): its T rows, one after another (AVX2 and portable).
void attention_task(const void* ctx, int64_t task) {
  const Attention& a = *static_cast<const Attention*>(ctx);
  const int64_t bi = task / (a.kv * a.g), head = task / a.g % a.kv, grp = task % a.g;
  const int64_t len = a.cache_len_of(bi), slots = a.s + a.t;
  thread_local std::vector<float> w;                     // [slots] scores, then weights
  thread_local std::vector<const float*> keys, values;  // [slots] the keys a row sees
  w.resize(slots);
  keys.resize(slots);
  values.resize(slots);
  for (int64_t tok = 0; tok < a.t; ++tok) {
    const int64_t row = a.row(bi, tok, head, grp);
    for (int64_t j = 0; j < len; ++j) {
      keys[j] = a.key(bi, head, j);
      values[j] = a.value(bi, head, j);
    }
    int64_t n = a.add_new(bi, head, tok, keys.data(), values.data(), len);
    float total;
    if (n > 0) {
      a.ops.scores(a.q + row * a.h, keys.data(), n, a.h, a.scale, w.data());
      total = a.ops.softmax(w.data(), n);
    } else {
      n = a.add_every_slot(bi, head, values.data(), w.data());
      total = static_cast<float>(n);
    }
    a.ops.values(w.data(), values.data(), n, a.h, total, a.out + row * a.h);
  }
}

#if PSPEC_X86
// One (sequence, key/value head, block of up to kBlockRows of the head's T*G rows; row i is token
// i / G, group i % G), AVX-512: the cache's keys and values are read once for the block, each
// row's own new tokens after them. A row's scores, softmax and running sums are those of the
// row alone over its list (`scores16` treats every key alike; one running sum per 16 columns in
// list order, kept in memory between the shared part and the row's own).
__attribute__((target("avx512f"))) void attention_block_task(const void* ctx, int64_t task) {
  const Attention& a = *static_cast<const Attention*>(ctx);
  const int64_t per_head = a.t * a.g, blocks = (per_head + kBlockRows - 1) / kBlockRows;
  const int64_t bi = task / (a.kv * blocks), head = task / blocks % a.kv;
  const int64_t first = task % blocks * kBlockRows;
  const int rows = static_cast<int>(std::min<int64_t>(kBlockRows, per_head - first));
  const int64_t len = a.cache_len_of(bi), slots = a.s + a.t;
  thread_local std::vector<float> w, acc, zeros;  // [rows, slots], [rows, H], [H]
  thread_local std::vector<const float*> keys, values;  // [slots], then each row's [slots]
  w.resize(kBlockRows * slots);
  acc.assign(kBlockRows * a.h, 0.0f);
  if (static_cast<int64_t>(zeros.size()) < a.h) zeros.assign(a.h, 0.0f);
  keys.resize((kBlockRows + 1) * slots);
  values.resize((kBlockRows + 1) * slots);
  for (int64_t j = 0; j < len; ++j) {
    keys[j] = a.key(bi, head, j);
    values[j] = a.value(bi, head, j);
  }
  const float* q[kBlockRows];
  float *wr[kBlockRows], *accr[kBlockRows], total[kBlockRows];
  const float **new_keys[kBlockRows], **new_values[kBlockRows];
  int64_t num_new[kBlockRows], out_row[kBlockRows];
  for (int r = 0; r < rows; ++r) {
    const int64_t tok = (first + r) / a.g, grp = (first + r) % a.g;
    out_row[r] = a.row(bi, tok, head, grp);
    q[r] = a.q + out_row[r] * a.h;
    wr[r] = w.data() + r * slots;
    accr[r] = acc.data() + r * a.h;
    new_keys[r] = keys.data() + (r + 1) * slots;
    new_values[r] = values.data() + (r + 1) * slots;
    num_new[r] = a.add_new(bi, head, tok, new_keys[r], new_values[r], 0);
  }
  scores_avx512(q, rows, keys.data(), len, a.h, a.scale, wr, zeros.data());
  for (int r = 0; r < rows; ++r) {
    float* w_new = wr[r] + len;
    scores_avx512(&q[r], 1, new_keys[r], num_new[r], a.h, a.scale, &w_new, zeros.data());
    const int64_t n = len + num_new[r];
    total[r] = n > 0 ? softmax_avx512(wr[r], n) : 0.0f;
  }
  values_avx512(wr, rows, values.data(), len, a.h, accr);
  for (int r = 0; r < rows; ++r) {
    if (len + num_new[r] > 0) {
      const float* w_new = wr[r] + len;
      values_avx512(&w_new, 1, new_values[r], num_new[r], a.h, &accr[r]);
    } else {
      const int64_t n = a.add_every_slot(bi, head, new_values[r], wr[r]);
      values_avx512(&wr[r], 1, new_values[r], n, a.h, &accr[r]);
      total[r] = static_cast<float>(n);
    }
    const __m512 total16 = _mm512_set1_ps(total[r]);
    float* out = a.out + out_row[r] * a.h;
    for (int64_t c = 0; c < a.h; c += 16)
      _mm512_storeu_ps(out + c, _mm512_div_ps(_mm512_loadu_ps(accr[r] + c), total16));
  }
}
#endif

ffi::Error DecodeAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                               ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> cache_len,
                               ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                               ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out,
                               float scale) {
  const auto qd = q.dimensions(), cd = k_cache.dimensions(), nd = k_new.dimensions();
  if (qd.size() != 5 || cd.size() != 4 || nd.size() != 4) {
    return ffi::Error::InvalidArgument(
        "decode_attention: q [B, T, KV, G, H], caches [B, S, KV, H], new [B, T, KV, H]");
  }
  const int64_t b = qd[0], t = qd[1], kv = qd[2], g = qd[3], h = qd[4], s = cd[1];
  const bool same = cd[0] == b && cd[2] == kv && cd[3] == h && v_cache.dimensions() == cd &&
                    nd[0] == b && nd[1] == t && nd[2] == kv && nd[3] == h &&
                    v_new.dimensions() == nd && cache_len.element_count() == b &&
                    mask.element_count() == b * t * t && out->element_count() == q.element_count();
  if (!same) return ffi::Error::InvalidArgument("decode_attention: shapes do not match");
  const Attention a{q.typed_data(),     k_cache.typed_data(), v_cache.typed_data(),
                    k_new.typed_data(), v_new.typed_data(),   cache_len.typed_data(),
                    mask.typed_data(),  out->typed_data(),    b, t, s, kv, g, h, scale,
                    row_ops(h)};
#if PSPEC_X86
  if (std::strncmp(isa().name, "avx512", 6) == 0 && h > 0 && h % 16 == 0) {
    pool().run({attention_block_task, &a, b * kv * ((t * g + kBlockRows - 1) / kBlockRows)});
    return ffi::Error::Success();
  }
#endif
  pool().run({attention_task, &a, b * kv * g});
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------
// Vocabulary rows: the argmax of a row of logits, and draws from its softmax. XLA:CPU reduces a
// row one element at a time (a max over 49,152 logits took 50 us) and draws a categorical
// sample from Gumbel noise of the row's length (230 us); here each is a few vector passes.
//
// Every kernel takes the leading axes of x as its rows R (vmap adds them).
// VocabArgmax: x [R, V] float32 -> [R] int32, the first index of each row's maximum, as
//   jnp.argmax (rows hold no NaN).
// VocabDraws: x [R, V] float32 logits (-inf: never drawn), bits [R, D, 2] uint32 -> [R, D]
//   int32: D draws without replacement from softmax(x_r), in the order drawn (the law of
//   Gumbel-top-D). Draw j reads u in [0, 1) from its 64 bits (53 used) and takes the first
//   token whose cumulative mass, over the tokens not drawn yet, passes u times their total:
//   the inverse of the distribution function. A token's mass is exp(x - max x) in float32
//   (exactly 0 at -inf); masses are summed in double, 16 at a time, and the total is the sum of
//   the same partial sums, so the scan lands on a token of positive mass. Masses below exp's
//   range (about 87 below the max) are 0; once only such tokens are left, they are weighed
//   again against their own max. A row without a finite logit draws token 0, as
//   jax.random.categorical does; past the finite logits the last draw repeats.
// VocabSoftmax: x [R, V] float32 -> [R, V] float32, softmax(x_r): the same masses over their
//   sum (in double). A row without a finite logit is all zeros; +inf logits share the mass.
// VocabRejection: one level of recursive rejection sampling (pspec_jax.accept): x [R, V] the
//   target's filtered logits at a node, logq [R, V] the draft log-distribution its drawn
//   children came from, tokens [R, C] int32 the children in the order tried (-1: no child),
//   from_q [R, C] int32 (1: drawn from q without replacement; 0: a point mass), uniform [R, C]
//   float32, bits [R, 2] uint32 -> slot [R] int32, bonus [R] int32. With r = softmax(x) and
//   pi the proposal of a child x_c (q renormalised over the siblings not tried yet, or the
//   point mass on x_c), child c is accepted iff u_c * sum(r) * pi(x_c) < r(x_c); on rejection r
//   becomes max(0, r / sum(r) - pi). slot is the accepted child's, or -1 if none; then bonus is
//   a draw from r (from softmax(x) if rounding emptied it) with the bits, as VocabDraws draws,
//   else -1. A drawn child of no q mass left is not tried. r and q are the same masses as
//   VocabDraws', their sums in double.

constexpr int64_t kVocabBlock = 16;  // masses per partial sum

float row_max_portable(const float* x, int64_t v) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < v; ++i) top = std::max(top, x[i]);
  return top;
}

int64_t first_equal_portable(const float* x, int64_t v, float top) {
  int64_t i = 0;
  while (i < v && !(x[i] == top)) ++i;
  return i;
}

void masses_portable(const float* x, int64_t v, float top, float* e) {
  for (int64_t i = 0; i < v; ++i) e[i] = std::exp(x[i] - top);
}

#if PSPEC_X86
__attribute__((target("avx2,fma"))) float row_max_avx2(const float* x, int64_t v) {
  __m256 a = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), b = a, c = a, d = a;
  int64_t i = 0;
  for (; i + 32 <= v; i += 32) {
    a = _mm256_max_ps(a, _mm256_loadu_ps(x + i));
    b = _mm256_max_ps(b, _mm256_loadu_ps(x + i + 8));
    c = _mm256_max_ps(c, _mm256_loadu_ps(x + i + 16));
    d = _mm256_max_ps(d, _mm256_loadu_ps(x + i + 24));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(a, b), _mm256_max_ps(c, d)));
  float top = row_max_portable(x + i, v - i);
  for (float l : lanes) top = std::max(top, l);
  return top;
}

__attribute__((target("avx2,fma"))) int64_t first_equal_avx2(const float* x, int64_t v,
                                                               float top) {
  const __m256 t = _mm256_set1_ps(top);
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), t, _CMP_EQ_OQ));
    if (hits != 0) return i + __builtin_ctz(static_cast<unsigned>(hits));
  }
  return i + first_equal_portable(x + i, v - i, top);
}

// exp(x - top) where x - top is above exp8's lower clamp, else 0 (-inf among them).
__attribute__((target("avx2,fma"))) void masses_avx2(const float* x, int64_t v, float top,
                                                     float* e) {
  const __m256 shift = _mm256_set1_ps(top), low = _mm256_set1_ps(-87.33654f);
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) {
    const __m256 t = _mm256_sub_ps(_mm256_loadu_ps(x + i), shift);
    _mm256_storeu_ps(e + i, _mm256_and_ps(exp8(t), _mm256_cmp_ps(t, low, _CMP_GE_OQ)));
  }
  if (i < v) {  // the last few through a padded vector: the same arithmetic per element
    alignas(32) float tail[8];
    std::fill_n(tail, 8, -std::numeric_limits<float>::infinity());
    std::copy(x + i, x + v, tail);
    alignas(32) float out[8];
    masses_avx2(tail, 8, top, out);
    std::copy(out, out + (v - i), e + i);
  }
}
#endif

struct VocabOps {
  float (*row_max)(const float* x, int64_t v);
  int64_t (*first_equal)(const float* x, int64_t v, float top);  // v if none
  void (*masses)(const float* x, int64_t v, float top, float* e);
};

VocabOps vocab_ops() {
#if PSPEC_X86
  if (std::strcmp(isa().name, "portable") != 0)
    return {row_max_avx2, first_equal_avx2, masses_avx2};
#endif
  return {row_max_portable, first_equal_portable, masses_portable};
}

struct ArgmaxArgs {
  const float* x;
  int32_t* out;
  int64_t v;
};

void argmax_row(const ArgmaxArgs& a, int64_t r) {
  const float* x = a.x + r * a.v;
  const VocabOps ops = vocab_ops();
  const int64_t i = ops.first_equal(x, a.v, ops.row_max(x, a.v));
  a.out[r] = static_cast<int32_t>(i < a.v ? i : 0);
}

// The sum of 16 masses in double, in one fixed order (pairs of lanes, then halves).
inline double block_sum(const float* e) {
  double a[8];
  for (int i = 0; i < 8; ++i) a[i] = static_cast<double>(e[i]) + static_cast<double>(e[i + 8]);
  for (int i = 0; i < 4; ++i) a[i] += a[i + 4];
  return (a[0] + a[2]) + (a[1] + a[3]);
}

// Each block's sum of e into `sums` (when given); returns their total, summed in block order.
inline double block_sums(const float* e, double* sums, int64_t blocks) {
  double total = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    const double sum = block_sum(e + b * kVocabBlock);
    if (sums != nullptr) sums[b] = sum;
    total += sum;
  }
  return total;
}

// Token t's mass taken out of e: its block summed again; returns the new total of `sums`.
inline double take_out(float* e, double* sums, int64_t blocks, int64_t t) {
  e[t] = 0.0f;
  sums[t / kVocabBlock] = block_sum(e + t / kVocabBlock * kVocabBlock);
  double total = 0;
  for (int64_t b = 0; b < blocks; ++b) total += sums[b];
  return total;
}

// Row x's masses exp(x - max x) into e (v floats, then zeros up to a multiple of 16), the
// `count` tokens of `drawn` left out (no mass, and not in the max), each block's sum into
// `sums` (when given); returns their total in double. A row without a finite logit (left) has
// no mass; +inf logits share all of it.
double row_masses(const float* x, int64_t v, float* e, double* sums = nullptr,
                  const int32_t* drawn = nullptr, int64_t count = 0);

// u in [0, 1) from the 64 random bits of draw j (53 used).
inline double unit(const uint32_t* bits, int64_t j) {
  const uint32_t* w = bits + j * 2;
  const uint64_t u53 = (static_cast<uint64_t>(w[0]) << 21) | (w[1] >> 11);
  return static_cast<double>(u53) * 0x1p-53;
}

// The token where the cumulative mass of e (`blocks` blocks, their sums in `sums`) passes
// `target` (below their total): the block first, then the token inside it. Where rounding ends a
// scan short, the last token of positive mass there (in the block, or in the row).
int64_t inverse_cdf(const float* e, const double* sums, int64_t blocks, double target) {
  double below = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (below + sums[b] <= target) {
      below += sums[b];
      continue;
    }
    const float* eb = e + b * kVocabBlock;
    for (int i = 0; i < kVocabBlock; ++i) {
      if (eb[i] > 0 && (below += eb[i]) > target) return b * kVocabBlock + i;
    }
    for (int i = kVocabBlock - 1; i >= 0; --i) {
      if (eb[i] > 0) return b * kVocabBlock + i;
    }
  }
  int64_t pick = blocks * kVocabBlock - 1;
  while (pick > 0 && !(e[pick] > 0)) --pick;
  return pick;
}

struct DrawsArgs {
  const float* x;
  const uint32_t* bits;
  int32_t* out;
  int64_t v, draws;
};

void draw_row(const DrawsArgs& a, int64_t r) {
  const float* x = a.x + r * a.v;
  int32_t* out = a.out + r * a.draws;
  const int64_t blocks = (a.v + kVocabBlock - 1) / kVocabBlock;
  thread_local std::vector<float> e;
  thread_local std::vector<double> sums;
  e.resize(blocks * kVocabBlock);
  sums.resize(blocks);
  // The masses of the tokens not drawn yet, relative to their own max (`count` drawn).
  const auto refill = [&](int64_t count) {
    return row_masses(x, a.v, e.data(), sums.data(), out, count);
  };
  double total = refill(0);
  for (int64_t j = 0; j < a.draws; ++j) {
    // Masses run out before the finite logits do where those lie beyond exp's range below the
    // max: the rest are weighed again against their own max, as Gumbel-top-D would draw them.
    if (!(total > 0) && j > 0) total = refill(j);
    if (!(total > 0)) {  // no finite logit left: token 0, or the last draw again
      std::fill_n(out + j, a.draws - j, j > 0 ? out[j - 1] : 0);
      return;
    }
    const double target = unit(a.bits, r * a.draws + j) * total;
    const int64_t pick = inverse_cdf(e.data(), sums.data(), blocks, target);
    out[j] = static_cast<int32_t>(pick);
    total = take_out(e.data(), sums.data(), blocks, pick);  // without replacement
  }
}

double row_masses(const float* x, int64_t v, float* e, double* sums, const int32_t* drawn,
                  int64_t count) {
  const float* src = x;
  if (count > 0) {  // the tokens drawn already get no mass (a copy of the row with them at -inf)
    thread_local std::vector<float> rest;
    rest.assign(x, x + v);
    for (int64_t k = 0; k < count; ++k) rest[drawn[k]] = -std::numeric_limits<float>::infinity();
    src = rest.data();
  }
  const VocabOps ops = vocab_ops();
  const float top = ops.row_max(src, v);
  const int64_t blocks = (v + kVocabBlock - 1) / kVocabBlock;
  std::fill(e + v, e + blocks * kVocabBlock, 0.0f);
  if (!(top > -std::numeric_limits<float>::infinity())) {
    std::fill_n(e, v, 0.0f);
    return 0;
  }
  if (top == std::numeric_limits<float>::infinity()) {  // +inf logits share all the mass
    for (int64_t i = 0; i < v; ++i) e[i] = src[i] == top ? 1.0f : 0.0f;
  } else {
    ops.masses(src, v, top, e);
  }
  return block_sums(e, sums, blocks);
}

struct SoftmaxArgs {
  const float* x;
  float* out;
  int64_t v;
};

void softmax_row(const SoftmaxArgs& a, int64_t r) {
  thread_local std::vector<float> e;
  e.resize((a.v + kVocabBlock - 1) / kVocabBlock * kVocabBlock);
  const double total = row_masses(a.x + r * a.v, a.v, e.data());
  const float scale = total > 0 ? static_cast<float>(1.0 / total) : 0.0f;
  float* out = a.out + r * a.v;
  for (int64_t i = 0; i < a.v; ++i) out[i] = e[i] * scale;
}

struct RejectionArgs {
  const float *x, *logq;
  const int32_t *tokens, *from_q;
  const float* uniform;
  const uint32_t* bits;
  int32_t *slot, *bonus;
  int64_t v, children;
};

void rejection_row(const RejectionArgs& a, int64_t row) {
  const int64_t v = a.v, blocks = (v + kVocabBlock - 1) / kVocabBlock;
  const float* x = a.x + row * v;
  const int32_t* tokens = a.tokens + row * a.children;
  const int32_t* from_q = a.from_q + row * a.children;
  const float* uniform = a.uniform + row * a.children;
  thread_local std::vector<float> r, q;
  thread_local std::vector<double> r_sums, q_sums;
  r.resize(blocks * kVocabBlock);
  r_sums.resize(blocks);
  double r_mass = row_masses(x, v, r.data(), r_sums.data());
  double q_mass = 0;
  bool drawn = false;
  for (int64_t c = 0; c < a.children; ++c) drawn |= tokens[c] >= 0 && from_q[c] != 0;
  if (drawn) {
    q.resize(blocks * kVocabBlock);
    q_sums.resize(blocks);
    q_mass = row_masses(a.logq + row * v, v, q.data(), q_sums.data());
  }
  a.slot[row] = -1;
  a.bonus[row] = -1;
  for (int64_t c = 0; c < a.children; ++c) {
    const int32_t t = tokens[c];
    if (t < 0 || t >= v) continue;
    const bool point = from_q[c] == 0;
    if (!point && !(q[t] > 0)) continue;  // q's support ran out before the siblings did
    const double pi = point ? 1.0 : q[t] / q_mass;
    if (r[t] > 0 && static_cast<double>(uniform[c]) * r_mass * pi < r[t]) {
      a.slot[row] = static_cast<int32_t>(c);
      return;
    }
    if (point) {  // max(0, r / sum(r) - point mass): r without x_c (its scale is free)
      r_mass = take_out(r.data(), r_sums.data(), blocks, t);
      continue;
    }
    // r_mass is 0 only where rounding emptied r (q_mass > 0: a drawn child of q mass was tried).
    const float r_scale = r_mass > 0 ? static_cast<float>(1.0 / r_mass) : 1.0f;
    const float q_scale = static_cast<float>(1.0 / q_mass);
    float* rp = r.data();
    const float* qp = q.data();
    for (int64_t i = 0; i < v; ++i) rp[i] = std::max(rp[i] * r_scale - qp[i] * q_scale, 0.0f);
    r_mass = block_sums(rp, r_sums.data(), blocks);
    q_mass = take_out(q.data(), q_sums.data(), blocks, t);
  }
  if (!(r_mass > 0)) r_mass = row_masses(x, v, r.data(), r_sums.data());
  if (!(r_mass > 0)) {  // no finite logit: token 0, as jax.random.categorical
    a.bonus[row] = 0;
    return;
  }
  a.bonus[row] = static_cast<int32_t>(
      inverse_cdf(r.data(), r_sums.data(), blocks, unit(a.bits, row) * r_mass));
}

// Rows of a vocabulary-sized last axis: the product of the leading dimensions (vmap adds them).
template <typename Dims>
int64_t leading(const Dims& d, size_t rank) {
  int64_t rows = 1;
  for (size_t i = 0; i < rank; ++i) rows *= d[i];
  return rows;
}

template <typename A, typename B>
bool same_lead(const A& a, const B& b, size_t rank) {
  for (size_t i = 0; i < rank; ++i)
    if (a[i] != b[i]) return false;
  return true;
}

// fn(args, r) for every row r, rows shared by the pool's threads.
template <typename Args, void (*fn)(const Args&, int64_t)>
void each_row(const Args& args, int64_t rows) {
  auto one = [](const void* c, int64_t r) { fn(*static_cast<const Args*>(c), r); };
  pool().run({one, &args, rows});
}

ffi::Error VocabSoftmaxImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  const auto xd = x.dimensions(), od = out->dimensions();
  if (xd.size() < 1 || od.size() != xd.size() || !same_lead(xd, od, xd.size())) {
    return ffi::Error::InvalidArgument("vocab_softmax: x [..., V], out of its shape");
  }
  const size_t lead = xd.size() - 1;
  each_row<SoftmaxArgs, softmax_row>({x.typed_data(), out->typed_data(), xd[lead]},
                                     leading(xd, lead));
  return ffi::Error::Success();
}

// cos and sin of RoPE's angles, as the C library's cosf and sinf give them: XLA:CPU's cos and
// sin are those calls, so the values are the bits XLA's path computes. One call serves q and k
// of every layer (XLA merges the identical calls); fused into the rotation, XLA:CPU computed
// them again for every head of every layer.
ffi::Error RopeCosSinImpl(ffi::Buffer<ffi::F32> angles, ffi::ResultBuffer<ffi::F32> cos_out,
                          ffi::ResultBuffer<ffi::F32> sin_out) {
  const size_t n = angles.element_count();
  if (cos_out->element_count() != n || sin_out->element_count() != n) {
    return ffi::Error::InvalidArgument("rope_cos_sin: cos and sin of the angles' shape");
  }
  const float* a = angles.typed_data();
  float* c = cos_out->typed_data();
  float* s = sin_out->typed_data();
  for (size_t i = 0; i < n; ++i) {
    c[i] = std::cos(a[i]);
    s[i] = std::sin(a[i]);
  }
  return ffi::Error::Success();
}

ffi::Error VocabArgmaxImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto xd = x.dimensions(), od = out->dimensions();
  if (xd.size() < 1 || xd[xd.size() - 1] < 1 || od.size() + 1 != xd.size() ||
      !same_lead(xd, od, od.size())) {
    return ffi::Error::InvalidArgument("vocab_argmax: x [..., V] with V >= 1, out [...]");
  }
  const size_t lead = xd.size() - 1;
  each_row<ArgmaxArgs, argmax_row>({x.typed_data(), out->typed_data(), xd[lead]},
                                   leading(xd, lead));
  return ffi::Error::Success();
}

ffi::Error VocabDrawsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U32> bits,
                          ffi::ResultBuffer<ffi::S32> out) {
  const auto xd = x.dimensions(), bd = bits.dimensions(), od = out->dimensions();
  const size_t lead = xd.size() - 1;
  if (xd.size() < 1 || xd[lead] < 1 || bd.size() != xd.size() + 1 || od.size() != xd.size() ||
      !same_lead(xd, bd, lead) || !same_lead(xd, od, lead) || bd[lead + 1] != 2 ||
      od[lead] != bd[lead]) {
    return ffi::Error::InvalidArgument("vocab_draws: x [..., V], bits [..., D, 2], out [..., D]");
  }
  each_row<DrawsArgs, draw_row>(
      {x.typed_data(), bits.typed_data(), out->typed_data(), xd[lead], bd[lead]},
      leading(xd, lead));
  return ffi::Error::Success();
}

ffi::Error VocabRejectionImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> logq,
                              ffi::Buffer<ffi::S32> tokens, ffi::Buffer<ffi::S32> from_q,
                              ffi::Buffer<ffi::F32> uniform, ffi::Buffer<ffi::U32> bits,
                              ffi::ResultBuffer<ffi::S32> slot, ffi::ResultBuffer<ffi::S32> bonus) {
  const auto xd = x.dimensions(), td = tokens.dimensions(), bd = bits.dimensions();
  const size_t lead = xd.size() - 1;
  const bool ok = xd.size() >= 1 && xd[lead] >= 1 && logq.dimensions().size() == xd.size() &&
                  same_lead(xd, logq.dimensions(), xd.size()) && td.size() == xd.size() &&
                  same_lead(xd, td, lead) && from_q.dimensions().size() == td.size() &&
                  same_lead(td, from_q.dimensions(), td.size()) &&
                  uniform.dimensions().size() == td.size() &&
                  same_lead(td, uniform.dimensions(), td.size()) && bd.size() == xd.size() &&
                  same_lead(xd, bd, lead) && bd[lead] == 2 &&
                  slot->dimensions().size() == lead && same_lead(xd, slot->dimensions(), lead) &&
                  bonus->dimensions().size() == lead && same_lead(xd, bonus->dimensions(), lead);
  if (!ok) {
    return ffi::Error::InvalidArgument(
        "vocab_rejection: x and logq [..., V], tokens, from_q and uniform [..., C], bits "
        "[..., 2], slot and bonus [...]");
  }
  each_row<RejectionArgs, rejection_row>(
      {x.typed_data(), logq.typed_data(), tokens.typed_data(), from_q.typed_data(),
       uniform.typed_data(), bits.typed_data(), slot->typed_data(), bonus->typed_data(), xd[lead],
       td[lead]},
      leading(xd, lead));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PanelMatmul, PanelMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RopeCosSin, RopeCosSinImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(VocabArgmax, VocabArgmaxImpl,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(VocabSoftmax, VocabSoftmaxImpl,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(VocabDraws, VocabDrawsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(VocabRejection, VocabRejectionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

// What the library reports of the kernel it loaded (pspec_jax.cpu_kernel.describe).
extern "C" const char* pspec_panel_matmul_isa() { return isa().name; }
extern "C" int pspec_panel_matmul_threads() { return pool().threads(); }
// The read-ahead budget in bytes, set to `bytes` where that is >= 0; returns the one before.
extern "C" int64_t pspec_read_ahead_bytes(int64_t bytes) {
  return bytes >= 0 ? read_ahead_bytes.exchange(bytes) : read_ahead_bytes.load();
}
