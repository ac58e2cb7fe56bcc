// k2serve CPU expert kernel: all CPU-resident routed experts of one MoE layer for one step in
// one call, reading the weights in their checkpoint format at the DRAM limit.
//
// Built on first use by k2serve.kernels.cpu (g++ -O3 -march=native -shared), loaded through
// ctypes (which releases the GIL for the whole call). No torch headers, no OpenMP: a small
// persistent thread pool per NUMA node, threads pinned to their node's CPUs when there is more
// than one node.
//
// Weight formats (per expert, row-major [out, in], `in` a multiple of 32):
//   INT4 (compressed-tensors pack-quantized, group 32): packed bytes [out, in/2] where byte b of
//     a 32-column group holds column 2b (low nibble) and 2b+1 (high nibble) as q+8; bf16 scales
//     [out, in/32]. The kernel reads this layout as stored: the activations are permuted once
//     per call instead (even columns of each group first, then odd), so a 16-byte load gives
//     16 low nibbles that meet x[even] and 16 high nibbles that meet x[odd].
//   FP8 (e4m3, 128x128 blocks): bytes [out, in]; float32 scale_inv [ceil(out/128), ceil(in/128)].
//     e4m3 -> fp16 bits by shifts (exact, subnormals too), hardware fp16 -> fp32, times 256 *
//     scale (the exponent bias difference is folded into the scale).
//   BF16: uint16 [out, in]; F32: float [out, in] (bf16-format experts of a float32 model).
// Every format is consumed 32 columns at a time as two 16-float vectors (lo, hi), dequantized in
// registers; the weights are never materialized in float32.
//
// One call (k2_moe_forward):
//   0. pairs (token, local expert, weight) are bucketed by expert (counting sort);
//   1. x -> the activation layout, threads split over (token, 1024 columns);
//   2. gate+up: work items (expert, block of intermediate rows); the same thread computes the
//      gate and up rows for all tokens routed to that expert (each weight row unpacked once
//      per group of <= 8 tokens), writes h = silu(g) * u in the layout down_proj reads;
//   3. down: work items = blocks of output rows; each item loops over the active experts in
//      order (waiting, per expert, for that expert's gate/up items: no barrier) and accumulates
//      weight * (down_e @ h) into its own rows (no atomics); the result is written in the
//      caller's dtype (float32, or bf16 rounded per finished row block);
//   4. with several NUMA nodes, node n's threads compute its share of every expert's gate/up
//      rows (intermediate dim split) and then its share of the output rows of down_proj
//      (hidden dim split; an expert's down waits for its gate/up rows of every node); those
//      row ranges are moved to node n's memory at load (k2_layer_bind, mbind). Each row is
//      computed exactly as on one node, so the result is bit-identical to a one-node run; no
//      partial sums to add.
// k2_moe_forward_shared: the same decode step with the layer's shared expert as a second layer
// of one expert (every token, weight 1) in the same pool job: its gate/up items after the routed
// experts' (filling their tail), its down rows added after theirs in each row block; one bf16
// rounding of the float32 sum.
// The decode step is elastic (Pool::run): a pool thread that does not get a core in time (torch's
// OpenMP threads spinning after their last op, another process) skips the step or joins it
// midway; no phase waits for a given thread, and every sum keeps its order.
// Prompt-sized steps with bf16 activations take the AMX tile path instead (k2amx.h, included
// below; k2_layer_set_tiles turns it on per layer where the CPU and the build have AMX).
// The absorbed MLA decode over the paged latent cache is in k2mla.h (k2_mla_decode), the
// thread pool in k2pool.h (both included: one translation unit).
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <chrono>
#include <atomic>
#include <cmath>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define K2_PAUSE() _mm_pause()
#else
#define K2_PAUSE() ((void)0)
#endif

// wait politely: spin a little, then give the core away (oversubscribed machines)
static inline void relax(int n) {
  if (n < 4000)
    K2_PAUSE();
  else
    std::this_thread::yield();
}

// Every helper that takes or returns a 16-float vector is inlined: without AVX-512 such values
// would otherwise cross calls through memory (the AVX2 build ran 30x slower).
#define K2_INLINE inline __attribute__((always_inline))

#if !defined(__AVX512F__) && defined(__AVX2__)
// AVX2: 16 floats as two ymm registers (GCC's 64-byte vector type spilled through the stack)
struct v16f {
  __m256 a, b;
};
static K2_INLINE v16f operator+(v16f x, v16f y) {
  return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)};
}
static K2_INLINE v16f operator*(v16f x, v16f y) {
  return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)};
}
static K2_INLINE v16f& operator+=(v16f& x, v16f y) {
  x.a = _mm256_add_ps(x.a, y.a);
  x.b = _mm256_add_ps(x.b, y.b);
  return x;
}
#define K2_V16_STRUCT 1
#else
typedef float v16f __attribute__((vector_size(64)));
#define K2_V16_STRUCT 0
#endif
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef uint16_t v16s __attribute__((vector_size(32)));
typedef _Float16 v16h __attribute__((vector_size(32)));

enum { FMT_INT4 = 0, FMT_FP8 = 1, FMT_BF16 = 2, FMT_F32 = 3 };
// INT4 weights with bf16 activations, through AVX512_BF16 dot products (internal format code);
// bf16 weights with bf16 activations likewise (dense layers, k2_linear)
enum { FMT_I4BF = 4, FMT_BFBF = 5 };
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define K2_HAS_I4BF 1
#else
#define K2_HAS_I4BF 0
#endif
enum { X_F32 = 0, X_BF16 = 1 };
#ifndef K2_SYNC_BARRIERS  // 1: the previous decode-path sync (before/after measurements): every
#define K2_SYNC_BARRIERS 0  // thread waits at a barrier after the prologue and after gate/up
#endif
#ifndef K2_I4BF_LEGACY  // 1: the previous INT4 x bf16 decode loop (before/after measurements)
#define K2_I4BF_LEGACY 0
#endif
static const int I4BF_COLS = K2_I4BF_LEGACY ? 64 : 128;  // columns per step of that loop

#if K2_V16_STRUCT
static K2_INLINE v16f loadf(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static K2_INLINE float hsum(v16f v) {
  __m256 s = _mm256_add_ps(v.a, v.b);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_hadd_ps(q, q);
  q = _mm_hadd_ps(q, q);
  return _mm_cvtss_f32(q);
}
#else
static K2_INLINE v16f loadf(const float* p) {
  v16f v;
  memcpy(&v, p, 64);
  return v;
}
static K2_INLINE float hsum(v16f v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}
#endif
static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
#if K2_V16_STRUCT
static K2_INLINE v16f splat(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
#else
static K2_INLINE v16f splat(float f) { return (v16f){} + f; }
#endif

// Software prefetch of weight bytes K2_PREFETCH ahead of the current read: one thread streams
// several rows at once and the hardware prefetchers alone left it latency-bound (dev CPU, one
// thread, batch 1: 11-12 -> 14-15 GB/s per CPU-second with 1024).
#ifndef K2_PREFETCH
#define K2_PREFETCH 1024
#endif
#ifndef K2_PREFETCH_L2  // 1: those prefetches (and the bf16 GEMV's into the next rows) fill L2
#define K2_PREFETCH_L2 0  // only, as the INT4 decode loop's do (K2_I4BF_PF); measurements only
#endif
#define K2_PF_HINT (K2_PREFETCH_L2 ? _MM_HINT_T1 : _MM_HINT_T0)
// Rows per dot_rows call at one token per expert (decode; the results are bit-identical for
// any value). 4 on the 16-core Xeon host (K2 layer at 1 token: 1.90-2.18 ms against 2.27-2.63
// with 1 on 16 threads, 10.2-11.1 against 11.3-13.3 on 2); 1 was 8-17% faster on the 2-core
// Zen 5 dev VM (benchmarks/runs/h100_w15_rows_t1.txt): not switched by vendor on that evidence.
#ifndef K2_ROWS_T1
#define K2_ROWS_T1 4
#endif
// The INT4 x bf16 decode loop's prefetch of the next rows it reads: the cache level it fills
// (0: no software prefetch, 1: L1 (_MM_HINT_T0, until wave 15), 2: L2 (_MM_HINT_T1)). Into L2
// the prefetches do not hold the L1 fill buffers the current rows' loads need: one K2 layer at
// 1 token on the 2-core Zen 5 dev VM 17.5 / 16.6 -> 11.0 / 11.0 ms on 1 thread, 9.4 / 9.5 ->
// 6.5 / 7.0 on 2 (none: 21-23 / 12); on the H100 host's Xeon the same within noise in
// cpu_moe.py (2 threads 10.8 -> 10.5-10.7 ms, 16: 1.90-2.40 either way) and the e2e's routed
// experts 666 -> 625 ms a token on 2 threads (benchmarks/runs/h100_w15_i4bf_pf/).
#ifndef K2_I4BF_PF
#define K2_I4BF_PF 2
#endif
#define K2_I4BF_HINT (K2_I4BF_PF == 2 ? _MM_HINT_T1 : _MM_HINT_T0)
#ifndef K2_BFBF_PF_LEGACY  // 1: the bf16 GEMV's previous prefetch and items of 32 rows (before/
#define K2_BFBF_PF_LEGACY 0  // after measurements)
#endif
#ifndef K2_LINEAR_PER_THREAD  // the bf16 GEMV's items per pool thread, at least (rows per item
#define K2_LINEAR_PER_THREAD 16  // 8..32)
#endif
static inline void prefetch_ahead(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  if (K2_PREFETCH > 0) _mm_prefetch((const char*)p + K2_PREFETCH, K2_PF_HINT);
#else
  (void)p;
#endif
}

// ---------------------------------------------------------------------------------------------
// One expert matrix (one NUMA node's slice of it).
struct Mat {
  const uint8_t* w;  // packed / fp8 / bf16 bytes, row-major
  const void* s;     // int4: bf16 [rows, cols/32]; fp8: float [ceil(rows/128), s_cols]
  int64_t row_bytes;  // bytes per row of w
  int cols;           // input features of this slice
  int s_cols;         // fp8: scale columns per row block; int4: scales per row
};

// Dequantize 32 columns (chunk c) of row r into lo (cols 0..15 of the chunk, or the even ones
// for INT4) and hi (cols 16..31, or the odd ones).
template <int FMT>
struct Deq;

#if !defined(__AVX512F__) && defined(__AVX2__)
static K2_INLINE v16f join8(__m256 a, __m256 b) { return {a, b}; }
#endif

template <>
struct Deq<FMT_INT4> {
  static K2_INLINE void load(const Mat& m, int r, int c, v16f& lo, v16f& hi) {
    const uint8_t* p = m.w + (int64_t)r * m.row_bytes + (int64_t)c * 16;
    float s = bf16_to_f32(((const uint16_t*)m.s)[(int64_t)r * m.s_cols + c]);
    v16f vs = splat(s), vo = splat(-8.f * s);
#if defined(__AVX512F__)
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    lo = (v16f)_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))) * vs + vo;
    hi = (v16f)_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)) * vs + vo;
#elif defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i*)p);
    __m256i q0 = _mm256_cvtepu8_epi32(b), q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    const __m256i m15 = _mm256_set1_epi32(15);
    lo = join8(_mm256_cvtepi32_ps(_mm256_and_si256(q0, m15)),
               _mm256_cvtepi32_ps(_mm256_and_si256(q1, m15))) * vs + vo;
    hi = join8(_mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)),
               _mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4))) * vs + vo;
#else
    v16b b;
    memcpy(&b, p, 16);
    v16i q = __builtin_convertvector(b, v16i);
    lo = __builtin_convertvector(q & 15, v16f) * vs + vo;
    hi = __builtin_convertvector(q >> 4, v16f) * vs + vo;
#endif
  }
};

static K2_INLINE v16f fp8x16(const uint8_t* p) {
#if defined(__AVX512F__)
  __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7),
                              _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
  return (v16f)_mm512_cvtph_ps(h);
#elif defined(__AVX2__) && defined(__F16C__)
  __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7),
                              _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
  return join8(_mm256_cvtph_ps(_mm256_castsi256_si128(h)),
               _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
#else
  v16b b;
  memcpy(&b, p, 16);
  v16s w = __builtin_convertvector(b, v16s);
  v16s h = (v16s)(((w & 0x7F) << 7) | ((w & 0x80) << 8));
  v16h hf;
  memcpy(&hf, &h, 32);
  return __builtin_convertvector(hf, v16f);
#endif
}

template <>
struct Deq<FMT_FP8> {
  static K2_INLINE void load(const Mat& m, int r, int c, v16f& lo, v16f& hi) {
    const uint8_t* p = m.w + (int64_t)r * m.row_bytes + (int64_t)c * 32;
    // e4m3 bits placed in fp16 are 2^-8 of the value: fold 256 into the block scale
    float s = 256.f * ((const float*)m.s)[(int64_t)(r >> 7) * m.s_cols + (c >> 2)];
    v16f vs = splat(s);
    lo = fp8x16(p) * vs;
    hi = fp8x16(p + 16) * vs;
  }
};

static K2_INLINE v16f bf16x16(const uint8_t* p) {
#if defined(__AVX512F__)
  __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return (v16f)_mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
#elif defined(__AVX2__)
  __m256i b = _mm256_loadu_si256((const __m256i*)p);
  __m256i u0 = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(b)), 16);
  __m256i u1 = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(b, 1)), 16);
  return join8(_mm256_castsi256_ps(u0), _mm256_castsi256_ps(u1));
#else
  v16s b;
  memcpy(&b, p, 32);
  v16u u = __builtin_convertvector(b, v16u) << 16;
  v16f f;
  memcpy(&f, &u, 64);
  return f;
#endif
}

template <>
struct Deq<FMT_BF16> {
  static K2_INLINE void load(const Mat& m, int r, int c, v16f& lo, v16f& hi) {
    const uint8_t* p = m.w + (int64_t)r * m.row_bytes + (int64_t)c * 64;
    lo = bf16x16(p);
    hi = bf16x16(p + 32);
  }
};

template <>
struct Deq<FMT_F32> {
  static K2_INLINE void load(const Mat& m, int r, int c, v16f& lo, v16f& hi) {
    const float* p = (const float*)(m.w + (int64_t)r * m.row_bytes) + c * 32;
    lo = loadf(p);
    hi = loadf(p + 16);
  }
};

// out[i * NT + t] = dot(row r0 + i of m, xs[t]) for i < R, t < NT. xs in the chunk layout
// (for INT4: per 32-column chunk, the 16 even columns then the 16 odd ones).
template <int FMT, int R, int NT>
static K2_INLINE void dot_rows_f32(const Mat& m, int r0, const void* const* xv, float* out) {
  const float* const* xs = (const float* const*)xv;
  v16f acc_lo[R][NT], acc_hi[R][NT];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) acc_lo[i][t] = acc_hi[i][t] = splat(0.f);
  const int chunks = m.cols >> 5;
  const int64_t cb = m.row_bytes / chunks;  // weight bytes per 32 columns
  for (int c = 0; c < chunks; ++c) {
    v16f lo[R], hi[R];
    if ((c * cb) % 64 == 0)
      for (int i = 0; i < R; ++i) prefetch_ahead(m.w + (int64_t)(r0 + i) * m.row_bytes + c * cb);
    for (int i = 0; i < R; ++i) Deq<FMT>::load(m, r0 + i, c, lo[i], hi[i]);
    for (int t = 0; t < NT; ++t) {
      v16f xl = loadf(xs[t] + c * 32), xh = loadf(xs[t] + c * 32 + 16);
      for (int i = 0; i < R; ++i) {
        acc_lo[i][t] += lo[i] * xl;
        acc_hi[i][t] += hi[i] * xh;
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) out[i * NT + t] = hsum(acc_lo[i][t] + acc_hi[i][t]);
}

#if K2_HAS_I4BF
// INT4 x bf16 activations, 128 columns (four groups) per 64-byte load, the stored bytes as they
// are: 16-bit word j of a 64-byte block holds columns 4j..4j+3 as its nibbles 0..3. Nibble u
// (= q + 8) becomes the bf16 value 128 + u by OR-ing 0x4300 into the shifted, masked word
// (exact), so four vdpbf16ps (one per nibble plane) do 128 exact products with float32 sums;
// float lane l of the result covers columns 8l..8l+7, i.e. group l / 4 of the block, and one
// FMA applies the four groups' scales at once: per group s * (dot(128 + u, x) - 136 * sum(x)).
// Activations arranged per 128 columns: plane k (k = 0..3) holds x[4j + k] for j = 0..31;
// sums[t][g] is the sum of group g's 32 activations. Needs cols % 128 == 0.
static const int I4BF_MAX_GROUPS = 1024;

// The R rows' group scales as float32: sf[i][g] (both loops below).
template <int R>
static K2_INLINE void i4bf_row_scales(const Mat& m, int r0, int groups,
                                      float (*sf)[I4BF_MAX_GROUPS]) {
  for (int i = 0; i < R; ++i) {
    const uint16_t* sp = (const uint16_t*)m.s + (int64_t)(r0 + i) * m.s_cols;
    int g = 0;
    for (; g + 16 <= groups; g += 16) {
      __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(sp + g)));
      _mm512_store_ps(&sf[i][g], _mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
    }
    for (; g < groups; ++g) sf[i][g] = bf16_to_f32(sp[g]);
  }
}

// out[i][t] = sum of acc[i][t] - 136 x the scales' dot with the activations' group sums: the
// stored nibbles as bf16 are 128 + u = (n - 8) + 136, so each product carried 136 x scale x x.
template <int R, int NT>
static K2_INLINE void i4bf_finish(const float (*sf)[I4BF_MAX_GROUPS], int groups,
                                  const float* const* sums, const __m512 (*acc)[NT], float* out) {
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) {
      __m512 c = _mm512_setzero_ps();
      int g = 0;
      for (; g + 16 <= groups; g += 16)
        c = _mm512_fmadd_ps(_mm512_load_ps(&sf[i][g]), _mm512_loadu_ps(sums[t] + g), c);
      float corr = _mm512_reduce_add_ps(c);
      for (; g < groups; ++g) corr += sf[i][g] * sums[t][g];
      out[i * NT + t] = _mm512_reduce_add_ps(acc[i][t]) - 136.f * corr;
    }
}

#if K2_I4BF_LEGACY
// The previous layout, for before/after measurements (--define K2_I4BF_LEGACY=1): 64 columns
// per 32-byte load widened to words, two FMAs per 64 columns, prefetch 1 KB ahead in the row.
template <int R, int NT>
static K2_INLINE void dot_rows_i4bf(const Mat& m, int r0, const void* const* xv,
                                 const float* const* sums, float* out, const uint8_t*,
                                 const uint8_t*) {
  const uint16_t* const* xs = (const uint16_t* const*)xv;
  const int groups = m.cols >> 5, pairs = m.cols >> 6;
  alignas(64) float sf[R][I4BF_MAX_GROUPS];
  i4bf_row_scales<R>(m, r0, groups, sf);
  __m512 acc[R][NT];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi16(0x0F), magic = _mm512_set1_epi16(0x4300);
  for (int p = 0; p < pairs; ++p) {
    __m512i lo[R], hi[R];
    __m512 sv[R];
    for (int i = 0; i < R; ++i) {
      const uint8_t* wp = m.w + (int64_t)(r0 + i) * m.row_bytes + (int64_t)p * 32;
      if ((p & 1) == 0) prefetch_ahead(wp);
      __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)wp));
      lo[i] = _mm512_ternarylogic_epi32(w, low, magic, 0xEA);  // (w & 0x0F) | 0x4300
      hi[i] = _mm512_or_si512(_mm512_srli_epi16(w, 4), magic);
      sv[i] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sf[i][2 * p]),
                                   _mm512_set1_ps(sf[i][2 * p + 1]));
    }
    for (int t = 0; t < NT; ++t) {
      const uint16_t* xp = xs[t] + (int64_t)p * 64;
      __m512bh xl = (__m512bh)_mm512_loadu_si512(xp);
      __m512bh xh = (__m512bh)_mm512_loadu_si512(xp + 32);
      for (int i = 0; i < R; ++i) {
        __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)lo[i], xl);
        d = _mm512_dpbf16_ps(d, (__m512bh)hi[i], xh);
        acc[i][t] = _mm512_fmadd_ps(sv[i], d, acc[i][t]);
      }
    }
  }
  i4bf_finish<R, NT>(sf, groups, sums, acc, out);
}

#else
// pw / ps: the first of the R rows (weights / scales, same row sizes as m) to prefetch while
// these R rows are read: the next R rows of this block, or the next block's first rows.
template <int R, int NT>
static K2_INLINE void dot_rows_i4bf(const Mat& m, int r0, const void* const* xv,
                                 const float* const* sums, float* out, const uint8_t* pw,
                                 const uint8_t* ps) {
  const uint16_t* const* xs = (const uint16_t* const*)xv;
  const int groups = m.cols >> 5, blocks = m.cols >> 7;
  alignas(64) float sf[R][I4BF_MAX_GROUPS];
  const int64_t sb = (int64_t)m.s_cols * 2;  // scale bytes per row
  if (K2_I4BF_PF > 0)
    for (int64_t o = 0; o < R * sb; o += 64) _mm_prefetch((const char*)ps + o, K2_I4BF_HINT);
  i4bf_row_scales<R>(m, r0, groups, sf);
  __m512 acc[R][NT];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi16(0x0F), magic = _mm512_set1_epi16(0x4300);
  const __m512i gidx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  for (int b = 0; b < blocks; ++b) {
    __m512i q[R][4];
    __m512 sv[R];
    for (int i = 0; i < R; ++i) {
      const uint8_t* wp = m.w + (int64_t)(r0 + i) * m.row_bytes + (int64_t)b * 64;
      if (K2_I4BF_PF > 0)
        _mm_prefetch((const char*)pw + (int64_t)i * m.row_bytes + (int64_t)b * 64, K2_I4BF_HINT);
      __m512i w = _mm512_loadu_si512(wp);
      q[i][0] = _mm512_ternarylogic_epi32(w, low, magic, 0xEA);  // (w & 0x0F) | 0x4300
      q[i][1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), low, magic, 0xEA);
      q[i][2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 8), low, magic, 0xEA);
      q[i][3] = _mm512_or_si512(_mm512_srli_epi16(w, 12), magic);
      sv[i] = _mm512_permutexvar_ps(gidx, _mm512_castps128_ps512(_mm_load_ps(&sf[i][4 * b])));
    }
    for (int t = 0; t < NT; ++t) {
      const uint16_t* xp = xs[t] + (int64_t)b * 128;
      __m512bh x0 = (__m512bh)_mm512_loadu_si512(xp), x1 = (__m512bh)_mm512_loadu_si512(xp + 32);
      __m512bh x2 = (__m512bh)_mm512_loadu_si512(xp + 64);
      __m512bh x3 = (__m512bh)_mm512_loadu_si512(xp + 96);
      for (int i = 0; i < R; ++i) {
        __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)q[i][0], x0);
        d = _mm512_dpbf16_ps(d, (__m512bh)q[i][1], x1);
        d = _mm512_dpbf16_ps(d, (__m512bh)q[i][2], x2);
        d = _mm512_dpbf16_ps(d, (__m512bh)q[i][3], x3);
        acc[i][t] = _mm512_fmadd_ps(sv[i], d, acc[i][t]);
      }
    }
  }
  i4bf_finish<R, NT>(sf, groups, sums, acc, out);
}
#endif  // K2_I4BF_LEGACY

// bf16 weights x bf16 activations: one vdpbf16ps per 32 products, no conversion at all.
// Prefetch K2_PREFETCH bytes ahead in each row; past a row's end, into row i of the next R rows
// the thread reads (pw: the first of them; rows of the same size), so that their first KB is not
// read cold (the rows are 3-16 KB: 7-33% of a row's bytes). K2_BFBF_PF_LEGACY=1: ahead in
// the same address range (past the end: the following row, already read but for the last).
template <int R, int NT>
static K2_INLINE void dot_rows_bfbf(const Mat& m, int r0, const void* const* xv, float* out,
                                    const uint8_t* pw = nullptr) {
  const uint16_t* const* xs = (const uint16_t* const*)xv;
  __m512 acc[R][NT];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  const int chunks = m.cols >> 5;
  for (int c = 0; c < chunks; ++c) {
    __m512i w[R];
    const int64_t off = (int64_t)c * 64 + K2_PREFETCH;
    const bool wrap = !K2_BFBF_PF_LEGACY && pw != nullptr && off >= m.row_bytes;
    for (int i = 0; i < R; ++i) {
      const uint8_t* wp = m.w + (int64_t)(r0 + i) * m.row_bytes + (int64_t)c * 64;
      if (wrap)
        _mm_prefetch((const char*)pw + (int64_t)i * m.row_bytes + (off - m.row_bytes),
                     K2_PF_HINT);
      else
        prefetch_ahead(wp);
      w[i] = _mm512_loadu_si512(wp);
    }
    for (int t = 0; t < NT; ++t) {
      __m512bh xb = (__m512bh)_mm512_loadu_si512(xs[t] + (int64_t)c * 32);
      for (int i = 0; i < R; ++i) acc[i][t] = _mm512_dpbf16_ps(acc[i][t], (__m512bh)w[i], xb);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) out[i * NT + t] = _mm512_reduce_add_ps(acc[i][t]);
}
#endif

template <int FMT, int R, int NT>
static K2_INLINE void dot_rows(const Mat& m, int r0, const void* const* xs, const float* const* sums,
                            float* out, const uint8_t* pw, const uint8_t* ps) {
  (void)pw;
  (void)ps;
#if K2_HAS_I4BF
  if constexpr (FMT == FMT_I4BF) {
    dot_rows_i4bf<R, NT>(m, r0, xs, sums, out, pw, ps);
    return;
  }
  if constexpr (FMT == FMT_BFBF) {
    (void)sums;
    dot_rows_bfbf<R, NT>(m, r0, xs, out, pw);
    return;
  }
#endif
  if constexpr (FMT != FMT_I4BF && FMT != FMT_BFBF) {
    (void)sums;
    dot_rows_f32<FMT, R, NT>(m, r0, xs, out);
  }
}

// rows [r0, r0 + nrows) x nt tokens (nt <= 8): out[i * 8 + t]. `next` / `next_r0`: the block
// the caller reads after this one (rows of the same size), prefetched (INT4 x bf16) while this
// block's last rows are read, so that a thread's stream does not restart cold at every block.
template <int FMT>
static void dot_block(const Mat& m, int r0, int nrows, const void* const* xs,
                      const float* const* sums, int nt, float* out, const Mat* next = nullptr,
                      int next_r0 = 0) {
  int i = 0;
  const bool nx = next && next->row_bytes == m.row_bytes && next->s_cols == m.s_cols;
  auto pfw = [&](int row) {  // weights of the row `row` rows after r0 (or of the next block)
    return row < nrows || !nx ? m.w + (int64_t)(r0 + row) * m.row_bytes
                              : next->w + (int64_t)(next_r0 + row - nrows) * m.row_bytes;
  };
  auto pfs = [&](int row) {
    const Mat& b = row < nrows || !nx ? m : *next;
    int r = row < nrows || !nx ? r0 + row : next_r0 + row - nrows;
    return (const uint8_t*)b.s + (int64_t)r * m.s_cols * 2;
  };
  switch (nt) {
#define K2_CASE(NT, R)                                                  \
  case NT:                                                              \
    for (; i + R <= nrows; i += R) {                                    \
      float tmp[R * NT];                                                \
      dot_rows<FMT, R, NT>(m, r0 + i, xs, sums, tmp, pfw(i + R), pfs(i + R));   \
      for (int a = 0; a < R; ++a)                                       \
        for (int t = 0; t < NT; ++t) out[(i + a) * 8 + t] = tmp[a * NT + t]; \
    }                                                                   \
    for (; i < nrows; ++i) {                                            \
      float tmp[NT];                                                    \
      dot_rows<FMT, 1, NT>(m, r0 + i, xs, sums, tmp, pfw(i + 1), pfs(i + 1));   \
      for (int t = 0; t < NT; ++t) out[i * 8 + t] = tmp[t];             \
    }                                                                   \
    break;
    K2_CASE(1, K2_ROWS_T1)
    K2_CASE(2, 4)
    K2_CASE(3, 2)
    K2_CASE(4, 2)
    K2_CASE(5, 2)
    K2_CASE(6, 1)
    K2_CASE(7, 1)
    K2_CASE(8, 1)
#undef K2_CASE
    default:
      break;
  }
}

// ---------------------------------------------------------------------------------------------
// Thread pool (k2pool.h): threads grouped by NUMA node; a job runs fn(node, rank in node)
// on every thread.
#include "k2pool.h"

// ---------------------------------------------------------------------------------------------
struct Layer {
  int fmt, E, H, I;
  std::vector<Mat> gate, up, down;  // [E] local experts
  int tiles = 0;          // 1: steps with bf16 activations may use the AMX path (k2amx.h)
  float tile_min = 0.f;   // ... when their pairs per active expert are at least this
  int tile_min_tokens = 0;  // ... and the step has at least this many tokens
};

// Seconds spent in the last call's parts, on the calling thread (k2_last_profile).
struct Profile {
  double bucket = 0, wake = 0, prologue = 0, gate_up = 0, down = 0, total = 0;
  int joined = 0, late = 0;  // decode step: workers that ran it / found gate/up handed out
};
static Profile g_profile;  // NOTE: written by the one call in flight (calls are serialized)
static inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Scratch {
  std::vector<float> x;       // [T, H] float32 (permuted for INT4), or bf16 arranged (I4BF)
  std::vector<float> h;       // [P, I] float32 in down_proj's input layout (or bf16, I4BF)
  std::vector<float> xsum, hsum;  // I4BF: per 32-column group sums of x / h
  std::vector<int> pair_tok, expert_start, active;
  std::vector<float> pair_w;
  std::vector<float> acc;  // [T, H] float32 sums when the caller takes bf16
  std::unique_ptr<std::atomic<int>[]> ready;  // per active expert: gate/up items done
  size_t ready_n = 0;
};

static const int RB1 = 32;  // gate/up rows per work item (whole INT4 groups of h)
static const int RB2 = 32;  // down rows per work item (longer streams per expert)

// Where column i of a row sits in the activation layout of format FMT (see the Deq / dot
// functions): INT4 even columns of each 32 first; I4BF per 128 columns four planes x[4j + k].
template <int FMT>
static inline int act_pos(int i) {
  if (FMT == FMT_INT4) {
    int c = i & 31;
    return (i & ~31) + ((c & 1) ? 16 + (c >> 1) : (c >> 1));
  }
  if (FMT == FMT_I4BF && K2_I4BF_LEGACY) {
    int c = i & 63, j = ((c >> 5) << 4) + ((c & 31) >> 1);
    return (i & ~63) + ((c & 1) ? 32 : 0) + j;
  }
  if (FMT == FMT_I4BF) {
    int c = i & 127;
    return (i & ~127) + (c & 3) * 32 + (c >> 2);
  }
  return i;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0x7F800000u) return (uint16_t)(u >> 16) | ((u & 0xFFFF) ? 0x40 : 0);
  u += 0x7FFF + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

// bytes per activation element
template <int FMT>
static constexpr int act_bytes() {
  return FMT == FMT_I4BF ? 2 : 4;
}

// node n's share [lo, hi) of `total` rows, in units of `align`, proportional to its threads
static void node_range(const Pool* P, int node, int total, int align, int& lo, int& hi) {
  int64_t before = 0, all = P->nthreads;
  for (int n = 0; n < node; ++n) before += P->node_size[n];
  int64_t units = (total + align - 1) / align;
  int64_t u0 = units * before / all, u1 = units * (before + P->node_size[node]) / all;
  lo = std::min<int64_t>(total, u0 * align);
  hi = std::min<int64_t>(total, u1 * align);
}

template <int FMT>
static void gate_up_item(const Layer* L, int e, int i0, int i1, const int* toks, int m,
                         const Scratch& sc, char* h_base, float* hsum, int slot0) {
  const Mat& G = L->gate[e];
  const Mat& U = L->up[e];
  const int H = L->H, I = L->I, AB = act_bytes<FMT>();
  const char* xb = (const char*)sc.x.data();
  float g[RB1 * 8], u[RB1 * 8];
  for (int t0 = 0; t0 < m; t0 += 8) {
    int nt = std::min(8, m - t0);
    const void* xs[8];
    const float* sums[8];
    for (int t = 0; t < nt; ++t) {
      xs[t] = xb + (int64_t)toks[t0 + t] * H * AB;
      sums[t] = FMT == FMT_I4BF ? sc.xsum.data() + (int64_t)toks[t0 + t] * (H / 32) : nullptr;
    }
    dot_block<FMT>(G, i0, i1 - i0, xs, sums, nt, g, &U, i0);
    dot_block<FMT>(U, i0, i1 - i0, xs, sums, nt, u);
    for (int t = 0; t < nt; ++t) {
      const int64_t slot = slot0 + t0 + t;
      float gs = 0.f;  // I4BF: running sum of the 32-group (i0 is a multiple of 32)
      for (int i = i0; i < i1; ++i) {
        float gv = g[(i - i0) * 8 + t], uv = u[(i - i0) * 8 + t];
        float hv = gv / (1.f + std::exp(-gv)) * uv;
        int pos = act_pos<FMT>(i);
        if (FMT == FMT_I4BF) {
          uint16_t hb = f32_to_bf16(hv);
          ((uint16_t*)h_base)[slot * I + pos] = hb;
          gs += bf16_to_f32(hb);
          if (((i + 1) & 31) == 0 || i + 1 == i1) {
            hsum[slot * (I / 32) + (i >> 5)] = gs;
            gs = 0.f;
          }
        } else {
          ((float*)h_base)[slot * I + pos] = hv;
        }
      }
    }
  }
}

template <int FMT>
static void down_item(const Layer* L, const Scratch& sc, int o0, int o1, float* out,
                      const std::atomic<int>* ready, int need) {
  const int H = L->H, I = L->I, AB = act_bytes<FMT>();
  const char* hb = (const char*)sc.h.data();
  float y[RB2 * 8];
  const int A = sc.active.size();
  for (int a = 0; a < A; ++a) {
    const int e = sc.active[a];
    for (int n = 0; ready[a].load(std::memory_order_acquire) < need; ++n) relax(n);
    const Mat* next = a + 1 < A ? &L->down[sc.active[a + 1]] : nullptr;
    int p0 = sc.expert_start[e], p1 = sc.expert_start[e + 1];
    for (int q0 = p0; q0 < p1; q0 += 8) {
      int nt = std::min(8, p1 - q0);
      const void* hs[8];
      const float* sums[8];
      for (int t = 0; t < nt; ++t) {
        hs[t] = hb + (int64_t)(q0 + t) * I * AB;
        sums[t] = FMT == FMT_I4BF ? sc.hsum.data() + (int64_t)(q0 + t) * (I / 32) : nullptr;
      }
      dot_block<FMT>(L->down[e], o0, o1 - o0, hs, sums, nt, y, q0 + 8 >= p1 ? next : nullptr, o0);
      for (int t = 0; t < nt; ++t) {
        float w = sc.pair_w[q0 + t];
        float* o = out + (int64_t)sc.pair_tok[q0 + t] * H;
        for (int r = o0; r < o1; ++r) o[r] += w * y[(r - o0) * 8 + t];
      }
    }
  }
}

// One barrier over every thread of the pool (between gate/up and down: h is read across nodes).
struct AllBarrier {
  std::atomic<int> count{0};
  std::atomic<int> phase{0};
  void wait(int n) {
    int ph = phase.load(std::memory_order_acquire);
    if (count.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
      count.store(0, std::memory_order_relaxed);
      phase.store(ph + 1, std::memory_order_release);
    } else {
      for (int i = 0; phase.load(std::memory_order_acquire) == ph; ++i) relax(i);
    }
  }
};

// The float32 sums of rows [o0, o1) of every token -> bf16 (round to nearest even)
static void rows_to_bf16(const float* acc, uint16_t* dst, int T, int H, int o0, int o1) {
  for (int t = 0; t < T; ++t)
    for (int r = o0; r < o1; ++r) dst[(int64_t)t * H + r] = f32_to_bf16(acc[(int64_t)t * H + r]);
}

// One layer's experts in a decode job: the routed experts, or (fused call) the shared expert as
// a second layer of one expert that every token takes with weight 1. Its own pairs and scratch.
struct Part {
  Layer* L = nullptr;  // null: no such part
  Scratch* sc = nullptr;
  int need = 0;  // gate/up items per expert over all nodes (prepare)
};

// Size the part's scratch for its pairs and reset its per-expert counters.
template <int FMT>
static void prepare(Part& p, const Pool* P) {
  Scratch& sc = *p.sc;
  const int I = p.L->I, Pn = sc.pair_tok.size(), A = sc.active.size();
  if (sc.h.size() < (size_t)Pn * I) sc.h.resize((size_t)Pn * I);
  if (FMT == FMT_I4BF && sc.hsum.size() < (size_t)Pn * (I / 32)) sc.hsum.resize((size_t)Pn * I / 32);
  p.need = 0;
  for (int n = 0; n < P->nnodes; ++n) {
    int r0, r1;
    node_range(P, n, I, 32, r0, r1);
    p.need += (r1 - r0 + RB1 - 1) / RB1;
  }
  if (sc.ready_n < (size_t)A) {
    sc.ready.reset(new std::atomic<int>[A]);
    sc.ready_n = A;
  }
  for (int a = 0; a < A; ++a) sc.ready[a].store(0, std::memory_order_relaxed);
}

// This node's gate/up items of a part: `nb` row blocks [r0, r1) per active expert.
struct NodeRows {
  int r0, r1, nb;
  NodeRows(const Pool* P, int node, int I) {
    node_range(P, node, I, 32, r0, r1);
    nb = (r1 - r0 + RB1 - 1) / RB1;
  }
};

// Item `it` (< active experts x nb) of a part's phase 1; counts for its expert when done.
template <int FMT>
static void gate_up_at(const Part& p, const NodeRows& nr, int64_t it) {
  Scratch& sc = *p.sc;
  const int a = it / nr.nb, e = sc.active[a];
  int i0 = nr.r0 + (int)(it % nr.nb) * RB1, i1 = std::min(nr.r1, i0 + RB1);
  int p0 = sc.expert_start[e], p1 = sc.expert_start[e + 1];
  gate_up_item<FMT>(p.L, e, i0, i1, sc.pair_tok.data() + p0, p1 - p0, sc, (char*)sc.h.data(),
                    sc.hsum.data(), p0);
  sc.ready[a].fetch_add(1, std::memory_order_release);
}

// An elastic pool job (Pool::run): no phase waits for a thread, only for work done, so a
// thread that starts late (its core busy elsewhere) joins where the work is or finds none.
//   prologue: returns once every token's activations are in place (counted per item);
//   phase 1: (expert, block of gate/up rows) items in expert order; each done item counts
//     for its expert in sc.ready; then the second part's (FMT2 >= 0: the shared expert's),
//     from the same counter, so they fill the first part's tail;
//   phase 2: blocks of output rows; a block takes the active experts in a fixed order (the
//     same sums in the same order as with a barrier) and waits only for that expert's gate/up
//     items, so down_proj starts while the last experts' gate/up items finish; the second
//     part's experts after the first's (a fixed order: deterministic).
// out: float32 sums [T, H]; out_bf16 (may be null): also written as bf16, per row block.
template <int FMT, int FMT2 = -1>
static void forward_impl(Pool* P, Part p1, Part p2, float* out, uint16_t* out_bf16, int T,
                         const std::function<void()>& prologue) {
  constexpr bool two = FMT2 >= 0;
  Layer* L = p1.L;
  const int H = L->H, nn = P->nnodes;
  for (int n = 0; n < nn; ++n) {
    P->sync[n].next.store(0);
    P->sync[n].next2.store(0);
  }
  prepare<FMT>(p1, P);
  if constexpr (two) prepare<FMT2>(p2, P);
  const int A = p1.sc->active.size(), A2 = two ? p2.sc->active.size() : 0;
  const double t_run = now_s();
  double t_in = 0, t_pro = 0, t_gu = 0;
  AllBarrier bar;  // K2_SYNC_BARRIERS only
  std::atomic<int> joined{0}, late{0};
  P->run(
      [&](int node, int rank) {
        Pool::NodeSync& s = P->sync[node];
        const bool caller = node == 0 && rank == 0;
        if (caller) t_in = now_s();
        if (!caller) joined.fetch_add(1, std::memory_order_relaxed);
        prologue();  // activations in the kernel's layout, output zeroed
        if (K2_SYNC_BARRIERS) bar.wait(P->nthreads);
        if (caller) t_pro = now_s();
        // phase 1: this node's rows of every active expert's gate + up (part 1, then part 2)
        const NodeRows nr1(P, node, L->I);
        const NodeRows nr2(P, node, two ? p2.L->I : 32);
        const int64_t items1 = (int64_t)A * nr1.nb, items = items1 + (int64_t)A2 * nr2.nb;
        for (bool first = true;; first = false) {
          int64_t it = s.next.fetch_add(1, std::memory_order_relaxed);
          if (it >= items) {
            if (first && !caller) late.fetch_add(1, std::memory_order_relaxed);
            break;
          }
          if (it < items1)
            gate_up_at<FMT>(p1, nr1, it);
          else if constexpr (two)
            gate_up_at<FMT2>(p2, nr2, it - items1);
        }
        if (K2_SYNC_BARRIERS) bar.wait(P->nthreads);
        if (caller) t_gu = now_s();
        // phase 2: this node's output rows, each row block owned by one thread
        int o0n, o1n;
        node_range(P, node, H, RB2, o0n, o1n);
        const int64_t items2 = (o1n - o0n + RB2 - 1) / RB2;
        for (;;) {
          int64_t it = s.next2.fetch_add(1, std::memory_order_relaxed);
          if (it >= items2) break;
          int o0 = o0n + (int)it * RB2, o1 = std::min(o1n, o0 + RB2);
          down_item<FMT>(L, *p1.sc, o0, o1, out, p1.sc->ready.get(), p1.need);
          if constexpr (two) down_item<FMT2>(p2.L, *p2.sc, o0, o1, out, p2.sc->ready.get(), p2.need);
          if (out_bf16) rows_to_bf16(out, out_bf16, T, H, o0, o1);
        }
      },
      /*elastic=*/!K2_SYNC_BARRIERS);
  const double t_end = now_s();
  g_profile.joined = joined.load();
  g_profile.late = late.load();
  g_profile.wake = t_in - t_run;
  g_profile.prologue = t_pro - t_in;
  g_profile.gate_up = t_gu - t_pro;
  g_profile.down = t_end - t_gu;
}

// 0. bucket the (token, expert) pairs by local expert (a counting sort; a repeated id makes
// two pairs). Returns 1 when an id is outside [0, num_global) (sc unchanged then), else 0.
static int bucket_pairs(Scratch& sc, int E, int T, int k, const int64_t* ids, const float* w,
                        const int32_t* local_of, int num_global) {
  std::vector<int> cnt(E + 1, 0);
  for (int64_t i = 0; i < (int64_t)T * k; ++i) {
    int64_t g = ids[i];
    if (g < 0 || g >= num_global) return 1;
    int le = local_of[g];
    if (le >= 0) cnt[le + 1]++;
  }
  sc.expert_start.assign(E + 1, 0);
  for (int e = 0; e < E; ++e) sc.expert_start[e + 1] = sc.expert_start[e] + cnt[e + 1];
  const int Pn = sc.expert_start[E];
  sc.pair_tok.resize(Pn);
  sc.pair_w.resize(Pn);
  std::vector<int> fill(sc.expert_start.begin(), sc.expert_start.end() - 1);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      int le = local_of[ids[(int64_t)t * k + j]];
      if (le < 0) continue;
      int q = fill[le]++;
      sc.pair_tok[q] = t;
      sc.pair_w[q] = w[(int64_t)t * k + j];
    }
  sc.active.clear();
  for (int e = 0; e < E; ++e)
    if (sc.expert_start[e + 1] > sc.expert_start[e]) sc.active.push_back(e);
  return 0;
}

// The shared expert's pairs: its one expert, every token, weight 1.
static void every_token_pairs(Scratch& sc, int T) {
  sc.expert_start.assign({0, T});
  sc.pair_tok.resize(T);
  sc.pair_w.assign(T, 1.f);
  for (int t = 0; t < T; ++t) sc.pair_tok[t] = t;
  sc.active.assign({0});
}

// The format the decode path computes layer L's experts in for activations of x_dtype: INT4
// with bf16 activations takes the INT4 x bf16 loop where it is built and the shapes fit.
static int decode_fmt(const Layer* L, int x_dtype) {
  const bool i4bf = L->fmt == FMT_INT4 && x_dtype == X_BF16 && K2_HAS_I4BF &&
                    L->H % I4BF_COLS == 0 && L->I % I4BF_COLS == 0 && L->H / 32 <= 1024 &&
                    L->I / 32 <= 1024;
  return i4bf ? FMT_I4BF : L->fmt;
}

// Make room for T tokens' activations in format kfmt.
static void size_x(Scratch& sc, int kfmt, int T, int H) {
  if (sc.x.size() < (size_t)T * H) sc.x.resize((size_t)T * H);
  if (kfmt == FMT_I4BF && sc.xsum.size() < (size_t)T * (H / 32)) sc.xsum.resize((size_t)T * H / 32);
}

// Columns [c0, c1) (multiples of 32) of token t's activations x -> sc.x in format kfmt's layout.
static void x_to_layout(Scratch& sc, int kfmt, int H, const void* x, int x_dtype, int t, int c0,
                        int c1) {
  float row[32];
  for (int c = c0; c < c1; c += 32) {
    if (x_dtype == X_BF16) {
      const uint16_t* src = (const uint16_t*)x + (int64_t)t * H + c;
      if (kfmt == FMT_I4BF) {
        uint16_t* dst = (uint16_t*)sc.x.data() + (int64_t)t * H;
        float gsum = 0.f;
        for (int j = 0; j < 32; ++j) {
          dst[act_pos<FMT_I4BF>(c + j)] = src[j];
          gsum += bf16_to_f32(src[j]);
        }
        sc.xsum[(int64_t)t * (H / 32) + c / 32] = gsum;
        continue;
      }
      for (int j = 0; j < 32; ++j) row[j] = bf16_to_f32(src[j]);
    } else {
      memcpy(row, (const float*)x + (int64_t)t * H + c, sizeof(row));
    }
    float* dst = sc.x.data() + (int64_t)t * H;
    if (kfmt == FMT_INT4) {
      for (int j = 0; j < 32; ++j) dst[act_pos<FMT_INT4>(c + j)] = row[j];
    } else {
      memcpy(dst + c, row, sizeof(row));
    }
  }
}

// A decode job's prologue: every thread of the job runs it, taking (token, 1024 columns) items
// from a counter (a one-token step's prologue is spread over 7 threads at K2's hidden size
// instead of one), and returns once all T x H are done. item(t, c0, c1) does one.
template <class F>
struct ChunkPrologue {
  static const int PC = 1024;
  std::atomic<int> next{0}, done{0};
  const int H, nch, items;
  F item;
  ChunkPrologue(int T, int H_, F f) : H(H_), nch((H_ + PC - 1) / PC), items(T * nch), item(f) {}
  void operator()() {
    for (;;) {
      const int it = next.fetch_add(1);
      if (it >= items) break;
      const int t = it / nch, c0 = (it % nch) * PC;
      item(t, c0, std::min(H, c0 + PC));
      done.fetch_add(1, std::memory_order_release);
    }
    for (int n = 0; done.load(std::memory_order_acquire) < items; ++n) relax(n);
  }
};

// The routed experts' decode job with the shared expert's second part (FMT2) in it.
template <int FMT2>
static void forward_shared_impl(int kfmt, Pool* P, Part p1, Part p2, float* out,
                                uint16_t* out_bf16, int T, const std::function<void()>& pro) {
  switch (kfmt) {
#if K2_HAS_I4BF
    case FMT_I4BF: forward_impl<FMT_I4BF, FMT2>(P, p1, p2, out, out_bf16, T, pro); break;
#endif
    case FMT_INT4: forward_impl<FMT_INT4, FMT2>(P, p1, p2, out, out_bf16, T, pro); break;
    case FMT_FP8: forward_impl<FMT_FP8, FMT2>(P, p1, p2, out, out_bf16, T, pro); break;
    case FMT_BF16: forward_impl<FMT_BF16, FMT2>(P, p1, p2, out, out_bf16, T, pro); break;
    default: forward_impl<FMT_F32, FMT2>(P, p1, p2, out, out_bf16, T, pro); break;
  }
}

#include "k2amx.h"
#include "k2mla.h"

static void mk_mat(Mat& m, int fmt, int64_t w, int64_t s, int cols) {
  m.w = (const uint8_t*)w;
  m.s = (const void*)s;
  m.cols = cols;
  if (fmt == FMT_INT4) {
    m.row_bytes = cols / 2;
    m.s_cols = cols / 32;
  } else if (fmt == FMT_FP8) {
    m.row_bytes = cols;
    m.s_cols = (cols + 127) / 128;
  } else {
    m.row_bytes = (int64_t)cols * (fmt == FMT_F32 ? 4 : 2);
    m.s_cols = 0;
  }
}

static int64_t scale_row_bytes(const Mat& m, int fmt) {
  return fmt == FMT_INT4 ? (int64_t)m.s_cols * 2 : fmt == FMT_FP8 ? (int64_t)m.s_cols * 4 : 0;
}

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
// Move the pages of [p, p + len) to NUMA node `node` (MPOL_BIND + MPOL_MF_MOVE); 0 or errno.
static int bind_range(const void* p, int64_t len, int node) {
#if defined(SYS_mbind)
  if (len <= 0 || node < 0 || node >= 64) return 0;
  const uintptr_t page = 4096;
  uintptr_t a = (uintptr_t)p & ~(page - 1);
  uintptr_t b = ((uintptr_t)p + len + page - 1) & ~(page - 1);
  unsigned long mask = 1UL << node;
  long r = syscall(SYS_mbind, a, b - a, 2 /*MPOL_BIND*/, &mask, 64, 2 /*MPOL_MF_MOVE*/);
  return r == 0 ? 0 : errno;
#else
  (void)p; (void)len; (void)node;
  return -1;
#endif
}
#else
static int bind_range(const void*, int64_t, int) { return -1; }
#endif

// ---------------------------------------------------------------------------------------------
extern "C" {

void* k2_pool_create(int nthreads, int nnodes, const int* node_of_thread, const int* cpus_flat,
                     const int* cpus_off, int pin, int spin) {
  Pool* p = new Pool();
  p->nthreads = std::max(1, nthreads);
  p->nnodes = std::max(1, nnodes);
  p->spin = spin;
  p->node_of.assign(node_of_thread, node_of_thread + p->nthreads);
  p->rank_of.resize(p->nthreads);
  p->node_size.assign(p->nnodes, 0);
  for (int t = 0; t < p->nthreads; ++t) p->rank_of[t] = p->node_size[p->node_of[t]]++;
  p->sync = std::vector<Pool::NodeSync>(p->nnodes);
  for (int t = 1; t < p->nthreads; ++t) {
    std::vector<int> cpus;
    if (pin) {
      int n = p->node_of[t];
      for (int i = cpus_off[n]; i < cpus_off[n + 1]; ++i) cpus.push_back(cpus_flat[i]);
    }
    p->threads.emplace_back([p, t, cpus] { p->worker(t, cpus); });
  }
  return p;
}

void k2_pool_destroy(void* p) { delete (Pool*)p; }

// Wake the pool's sleeping workers and keep them spinning for `usec` (see Pool::prewake); no
// lock: callable while another thread's call runs.
void k2_pool_prewake(void* p, int usec) { ((Pool*)p)->prewake(usec); }

// Tests: worker `rank` (1..nthreads-1; -1: none) sleeps `usec` before each job it runs, as a
// thread whose core is taken by another would start late. Results must not change.
void k2_pool_delay(void* p, int rank, int usec) {
  Pool* P = (Pool*)p;
  std::lock_guard<std::mutex> call(P->call_mu);
  P->delay_rank = rank;
  P->delay_us = usec;
}

// ptrs: per expert gate_w, gate_s, up_w, up_s, down_w, down_s (6 * E int64 addresses)
void* k2_layer_create(int fmt, int E, int H, int I, const int64_t* ptrs) {
  Layer* L = new Layer();
  L->fmt = fmt;
  L->E = E;
  L->H = H;
  L->I = I;
  L->gate.resize(E);
  L->up.resize(E);
  L->down.resize(E);
  for (int e = 0; e < E; ++e) {
    const int64_t* q = ptrs + 6 * e;
    mk_mat(L->gate[e], fmt, q[0], q[1], H);
    mk_mat(L->up[e], fmt, q[2], q[3], H);
    mk_mat(L->down[e], fmt, q[4], q[5], I);
  }
  return L;
}

void k2_layer_destroy(void* l) { delete (Layer*)l; }

// Let steps with bf16 activations, at least `min_tokens` tokens and at least `min_pairs`
// (token, expert) pairs per active expert use the AMX path. Returns 1 when it is on (AMX built and granted, format INT4 / FP8 /
// BF16), else 0 (every step takes the decode path).
int k2_layer_set_tiles(void* layer, int on, float min_pairs, int min_tokens) {
  Layer* L = (Layer*)layer;
  const bool fmt_ok = L->fmt == FMT_INT4 || L->fmt == FMT_FP8 || L->fmt == FMT_BF16;
  L->tiles = on && fmt_ok && K2_HAS_AMX && amx_permitted() && L->H % 32 == 0 && L->I % 32 == 0;
  L->tile_min = min_pairs;
  L->tile_min_tokens = min_tokens;
  return L->tiles;
}

// 1 when this build has the AMX path and the process may use the tile unit.
int k2_amx_available() { return K2_HAS_AMX && amx_permitted(); }

// Move each expert's rows to the NUMA node whose threads read them (node_ids[n] = the kernel
// node n's id in /sys). Returns the number of ranges the kernel refused to move.
int k2_layer_bind(void* layer, void* pool, const int* node_ids) {
  Layer* L = (Layer*)layer;
  Pool* P = (Pool*)pool;
  int failed = 0;
  for (int n = 0; n < P->nnodes; ++n) {
    int r0, r1, o0, o1;
    node_range(P, n, L->I, 32, r0, r1);
    node_range(P, n, L->H, RB2, o0, o1);
    for (int e = 0; e < L->E; ++e) {
      const Mat* ms[3] = {&L->gate[e], &L->up[e], &L->down[e]};
      for (int j = 0; j < 3; ++j) {
        const Mat& m = *ms[j];
        int a = j < 2 ? r0 : o0, b = j < 2 ? r1 : o1;
        failed += bind_range(m.w + (int64_t)a * m.row_bytes, (int64_t)(b - a) * m.row_bytes,
                             node_ids[n]) != 0;
        if (L->fmt == FMT_INT4) {
          int64_t sb = scale_row_bytes(m, L->fmt);
          failed += bind_range((const char*)m.s + a * sb, (int64_t)(b - a) * sb, node_ids[n]) != 0;
        }
      }
    }
  }
  return failed;
}

// hidden x [T, H] (f32 or bf16), topk ids [T, k] int64 (global ids), weights [T, k] f32,
// local_of [num_global] int32 (-1: not an expert of this layer object), out [T, H] in
// out_dtype (X_F32: float32; X_BF16: bf16, the float32 sums rounded to nearest even; written
// by the kernel's threads, so the caller needs no conversion pass) (overwritten; rows of tokens
// without a local expert are zero). Returns 0, 1 when an expert id is outside [0, num_global)
// (nothing is computed then), 2 for an unknown out_dtype.
int k2_moe_forward(void* layer, void* pool, int T, int k, const void* x, int x_dtype,
                   const int64_t* ids, const float* w, const int32_t* local_of, int num_global,
                   void* out_arg, int out_dtype) {
  if (out_dtype != X_F32 && out_dtype != X_BF16) return 2;
  Layer* L = (Layer*)layer;
  Pool* P = (Pool*)pool;
  const int H = L->H, E = L->E;
  std::lock_guard<std::mutex> call(P->call_mu);
  const double t_start = now_s();
  g_profile = Profile();
  // NOTE: a reference, so that the lambdas run on the pool's threads see the caller's scratch
  static thread_local Scratch tl_scratch;
  Scratch& sc = tl_scratch;
  if (bucket_pairs(sc, E, T, k, ids, w, local_of, num_global)) return 1;
  const int Pn = sc.expert_start[E];
  g_profile.bucket = now_s() - t_start;
  // 1. zero the output; x -> the activation layout (threads split over rows)
  const int fmt = L->fmt;
  const int kfmt = decode_fmt(L, x_dtype);
  size_x(sc, kfmt, T, H);
  // bf16 out: the float32 sums go to scratch, each row block is rounded once it is complete
  uint16_t* out_bf16 = out_dtype == X_BF16 ? (uint16_t*)out_arg : nullptr;
  if (out_bf16 && sc.acc.size() < (size_t)T * H) sc.acc.resize((size_t)T * H);
  float* out = out_bf16 ? sc.acc.data() : (float*)out_arg;
  ChunkPrologue prologue(T, H, [&](int t, int c0, int c1) {
    memset(out + (int64_t)t * H + c0, 0, sizeof(float) * (c1 - c0));
    x_to_layout(sc, kfmt, H, x, x_dtype, t, c0, c1);
  });
  if (Pn == 0) {  // no pair on these experts: zeros
    memset(out_arg, 0, (out_bf16 ? 2 : 4) * (size_t)T * H);
    return 0;
  }
#if K2_HAS_AMX
  // prompts: the expert GEMMs on the tile unit (k2amx.h)
  // NOTE: steps under tile_min_tokens tokens (decode batches) always take the decode path: a
  // decode step padded to a CUDA-graph bucket has more pairs than the same step run eagerly,
  // and the two paths round differently, so graphs and eager would drift apart
  if (L->tiles && x_dtype == X_BF16 && T >= L->tile_min_tokens &&
      Pn >= L->tile_min * (float)sc.active.size()) {
    const uint16_t* xb = (const uint16_t*)x;
    if (fmt == FMT_INT4)
      forward_tiles<FMT_INT4>(L, P, sc, T, xb, out);
    else if (fmt == FMT_FP8)
      forward_tiles<FMT_FP8>(L, P, sc, T, xb, out);
    else
      forward_tiles<FMT_BF16>(L, P, sc, T, xb, out);
    if (out_bf16) {  // a prompt's step: one more pass over [T, H] is noise against its GEMMs
      std::atomic<int> row{0};
      P->run([&](int, int) {
        for (int t; (t = row.fetch_add(1)) < T;) rows_to_bf16(out + (int64_t)t * H, out_bf16 + (int64_t)t * H, 1, H, 0, H);
      }, /*elastic=*/true);
    }
    g_profile.total = now_s() - t_start;
    return 0;
  }
#endif
  // 2, 3. gate + up, then down
  const Part p1{L, &sc}, none{};
  std::function<void()> pro = std::ref(prologue);
  switch (kfmt) {
#if K2_HAS_I4BF
    case FMT_I4BF: forward_impl<FMT_I4BF>(P, p1, none, out, out_bf16, T, pro); break;
#endif
    case FMT_INT4: forward_impl<FMT_INT4>(P, p1, none, out, out_bf16, T, pro); break;
    case FMT_FP8: forward_impl<FMT_FP8>(P, p1, none, out, out_bf16, T, pro); break;
    case FMT_BF16: forward_impl<FMT_BF16>(P, p1, none, out, out_bf16, T, pro); break;
    default: forward_impl<FMT_F32>(P, p1, none, out, out_bf16, T, pro); break;
  }
  g_profile.total = now_s() - t_start;
  return 0;
}

// A decode step of a MoE layer with a shared expert, in one pool job: out = sum_j w_j E_j(x)
// + S(x), the routed experts E_j of `layer` (as k2_moe_forward) and the shared expert S, the
// one expert of `shared_layer` (bf16 or float32 weights, same hidden size), every token with
// weight 1. Each output row sums the routed experts' down rows in k2_moe_forward's order, then
// the shared expert's, in float32; bf16 out is rounded once, from that sum. Always the decode
// path (no AMX tiles: meant for decode steps). Arguments and codes as k2_moe_forward's; also
// 3: the shared layer is not one bf16 / float32 expert of the routed layer's hidden size.
int k2_moe_forward_shared(void* layer, void* shared_layer, void* pool, int T, int k,
                          const void* x, int x_dtype, const int64_t* ids, const float* w,
                          const int32_t* local_of, int num_global, void* out_arg, int out_dtype) {
  if (out_dtype != X_F32 && out_dtype != X_BF16) return 2;
  Layer* L = (Layer*)layer;
  Layer* S = (Layer*)shared_layer;
  Pool* P = (Pool*)pool;
  const int H = L->H, E = L->E;
  if (S->E != 1 || S->H != H || (S->fmt != FMT_BF16 && S->fmt != FMT_F32)) return 3;
  std::lock_guard<std::mutex> call(P->call_mu);
  const double t_start = now_s();
  g_profile = Profile();
  static thread_local Scratch tl_routed, tl_shared;  // references below (see k2_moe_forward)
  Scratch& sc = tl_routed;
  Scratch& ss = tl_shared;
  if (bucket_pairs(sc, E, T, k, ids, w, local_of, num_global)) return 1;
  every_token_pairs(ss, T);
  g_profile.bucket = now_s() - t_start;
  const int kfmt = decode_fmt(L, x_dtype), sfmt = decode_fmt(S, x_dtype);
  size_x(sc, kfmt, T, H);
  size_x(ss, sfmt, T, H);
  uint16_t* out_bf16 = out_dtype == X_BF16 ? (uint16_t*)out_arg : nullptr;
  if (out_bf16 && sc.acc.size() < (size_t)T * H) sc.acc.resize((size_t)T * H);
  float* out = out_bf16 ? sc.acc.data() : (float*)out_arg;
  ChunkPrologue prologue(T, H, [&](int t, int c0, int c1) {
    memset(out + (int64_t)t * H + c0, 0, sizeof(float) * (c1 - c0));
    if (!sc.active.empty()) x_to_layout(sc, kfmt, H, x, x_dtype, t, c0, c1);
    x_to_layout(ss, sfmt, H, x, x_dtype, t, c0, c1);
  });
  std::function<void()> pro = std::ref(prologue);
  const Part p1{L, &sc}, p2{S, &ss};
  if (sfmt == FMT_BF16)
    forward_shared_impl<FMT_BF16>(kfmt, P, p1, p2, out, out_bf16, T, pro);
  else
    forward_shared_impl<FMT_F32>(kfmt, P, p1, p2, out, out_bf16, T, pro);
  g_profile.total = now_s() - t_start;
  return 0;
}

// The last call's timings in seconds: bucket, wake (pool start), prologue, gate_up, down, total.
void k2_last_profile(double* out6) {
  const Profile& p = g_profile;
  double v[6] = {p.bucket, p.wake, p.prologue, p.gate_up, p.down, p.total};
  memcpy(out6, v, sizeof(v));
}

// The last decode step's workers (the calling thread not counted): out[0] ran it, out[1] of
// those found every gate/up item handed out (woke late); the rest never came (elastic step).
void k2_last_workers(int* out2) {
  out2[0] = g_profile.joined;
  out2[1] = g_profile.late;
}

// Read nbytes at p with the pool's threads (each node reads its share), summing 32-bit words as
// floats: the benchmarks' memory read bandwidth probe, on the same threads as the kernel.
double k2_stream_read(void* pool, const void* p, int64_t nbytes) {
  Pool* P = (Pool*)pool;
  std::lock_guard<std::mutex> call(P->call_mu);
  const int64_t chunk = 1 << 20;
  const int64_t nchunks = nbytes / chunk;
  std::atomic<int64_t> next{0};
  std::vector<double> part(P->nthreads, 0.0);
  std::atomic<int> slot{0};
  P->run([&](int, int) {  // elastic: a late thread finds the chunks taken
    int me = slot.fetch_add(1);
    v16f a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (;;) {
      int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= nchunks) break;
      const float* f = (const float*)((const char*)p + i * chunk);
      for (int64_t j = 0; j < chunk / 4; j += 64) {
        a0 += loadf(f + j);
        a1 += loadf(f + j + 16);
        a2 += loadf(f + j + 32);
        a3 += loadf(f + j + 48);
      }
    }
    part[me] = hsum(a0 + a1 + a2 + a3);
  }, /*elastic=*/true);
  double s = 0;
  for (double v : part) s += v;
  return s;
}

#ifndef K2_HEADS_ITEM  // bytes of weight rows per work item of the per-head GEMV (at most a head)
#define K2_HEADS_ITEM 131072
#endif
#ifndef K2_HEADS_PER_THREAD  // at least this many items per pool thread
#define K2_HEADS_PER_THREAD 8
#endif
#ifndef K2_HEADS_PF  // its prefetch distance, in blocks of 16 / T rows (0: none)
#define K2_HEADS_PF 1
#endif
#ifndef K2_HEADS_LEGACY  // 1: k2_linear_batched's per-row path at T <= 2 too (benchmarks)
#define K2_HEADS_LEGACY 0
#endif

#if K2_HAS_I4BF
extern "C++" {  // templates, inside the library's extern "C" block
// Sums of 16 vectors: lane s of the result = the sum of v[s]'s 16 lanes (a transpose tree: 45
// shuffles / adds for 16 rows instead of 16 horizontal reductions of ~8 dependent steps each).
static K2_INLINE __m512 hsum16(const __m512* v) {
  __m512 u[8], w[4], x[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: v[i], v[i + 8]
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44),
                         _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int j = 0; j < 4; ++j)  // 128-bit lanes: v[j], v[j + 8], v[j + 4], v[j + 12]
    w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(u[j], u[j + 4], 0x88),
                         _mm512_shuffle_f32x4(u[j], u[j + 4], 0xDD));
  for (int k = 0; k < 2; ++k)  // float pairs of lane L: w[k]'s, w[k + 2]'s
    x[k] = _mm512_add_ps(_mm512_shuffle_ps(w[k], w[k + 2], 0x44),
                         _mm512_shuffle_ps(w[k], w[k + 2], 0xEE));
  __m512 y = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xDD));
  // lane 4L + f of y holds v[m(L) + g(f)], m = {0, 8, 4, 12}, g = {0, 2, 1, 3}: back to order
  const __m512i idx = _mm512_set_epi32(15, 13, 14, 12, 7, 5, 6, 4, 11, 9, 10, 8, 3, 1, 2, 0);
  return _mm512_permutexvar_ps(idx, y);
}

// 16 / NT rows of one head x NT tokens (bf16 x bf16): acc slot i * NT + t, reduced together.
// w: the first row's bytes (rows `rb` bytes apart), xs[t]: token t's K activations.
template <int NT>
static K2_INLINE __m512 dot16_bfbf(const uint8_t* w, int64_t rb, int K, const uint16_t* const* xs,
                                   int64_t pf) {
  constexpr int R = 16 / NT;
  __m512 acc[16];
  for (int s = 0; s < 16; ++s) acc[s] = _mm512_setzero_ps();
  for (int c = 0; c < K; c += 32) {
    __m512bh xb[NT];
    for (int t = 0; t < NT; ++t) xb[t] = (__m512bh)_mm512_loadu_si512(xs[t] + c);
    for (int i = 0; i < R; ++i) {
      const uint8_t* wp = w + i * rb + (int64_t)c * 2;
      if (K2_HEADS_PF > 0) _mm_prefetch((const char*)wp + pf, _MM_HINT_T0);
      __m512bh wv = (__m512bh)_mm512_loadu_si512(wp);
      for (int t = 0; t < NT; ++t) acc[i * NT + t] = _mm512_dpbf16_ps(acc[i * NT + t], wv, xb[t]);
    }
  }
  return hsum16(acc);
}

// k2_linear_batched for bf16 x bf16 at T <= 2 (decode; the absorbed MLA weights: W_UK^T rows of
// 128, W_UV rows of 512): items of (head, up to K2_HEADS_ITEM bytes of its rows: K2's whole
// head, 128 KB) from a counter, each read as one stream (items of 32 KB read ~20% slower: every
// item restarts the stream) in blocks of 16 / T rows whose sums are reduced together (no per-row
// horizontal sum, which bounded rows of 128), prefetching one block ahead.
// out: float32, or bf16 (BF: rounded here, to nearest even; torch's float -> bf16 .to() took
// ~80 us for [1, 64, 512] on the dev box, a quarter of the GEMV).
template <int NT, bool BF>
static void linear_heads_bfbf(Pool* P, const uint16_t* W, int B, int N, int K, const uint16_t* x,
                              void* out_) {
  float* out = (float*)out_;
  uint16_t* outb = (uint16_t*)out_;
  auto put = [&](int64_t i, float v) {
    if constexpr (BF)
      outb[i] = f32_to_bf16(v);
    else
      out[i] = v;
  };
  constexpr int R = 16 / NT;
  const int64_t rb = (int64_t)K * 2;
  // item bytes: up to K2_HEADS_ITEM, but >= K2_HEADS_PER_THREAD items per thread (a call's last
  // item is the wait: 16 threads over K2's 8.4 MB get items of 64 KB), at least 32 KB
  const int64_t total = (int64_t)B * N * rb;
  const int64_t ib = std::max<int64_t>(
      32768, std::min<int64_t>(K2_HEADS_ITEM, total / (K2_HEADS_PER_THREAD * P->nthreads)));
  int RB = std::max<int>(R, (int)(ib / rb) / R * R);  // rows per item
  if (RB > N) RB = (N + R - 1) / R * R;
  const int64_t per_b = (N + RB - 1) / RB, items = per_b * B;
  std::atomic<int64_t> next{0};
  P->run([&](int, int) {
    alignas(64) float sums[16];
    for (;;) {
      const int64_t it = next.fetch_add(1, std::memory_order_relaxed);
      if (it >= items) break;
      const int b = (int)(it / per_b);
      const int r0 = (int)(it % per_b) * RB, r1 = std::min(N, r0 + RB);
      const uint8_t* wb = (const uint8_t*)W + (int64_t)b * N * rb;
      const uint16_t* xs[NT];
      for (int t = 0; t < NT; ++t) xs[t] = x + ((int64_t)t * B + b) * K;
      int r = r0;
      for (; r + R <= r1; r += R) {
        __m512 y = dot16_bfbf<NT>(wb + r * rb, rb, K, xs, K2_HEADS_PF * R * rb);
        if constexpr (NT == 1 && BF) {
          _mm256_storeu_si256((__m256i*)(outb + (int64_t)b * N + r), (__m256i)_mm512_cvtneps_pbh(y));
        } else if constexpr (NT == 1) {
          _mm512_storeu_ps(out + (int64_t)b * N + r, y);
        } else {
          _mm512_store_ps(sums, y);
          for (int t = 0; t < NT; ++t)
            for (int i = 0; i < R; ++i) put(((int64_t)t * B + b) * N + r + i, sums[i * NT + t]);
        }
      }
      for (; r < r1; ++r) {  // tail rows of the head
        float o[NT];
        Mat m;
        m.w = wb, m.s = nullptr, m.row_bytes = rb, m.cols = K, m.s_cols = 0;
        dot_rows_bfbf<1, NT>(m, r, (const void* const*)xs, o);
        for (int t = 0; t < NT; ++t) put(((int64_t)t * B + b) * N + r, o[t]);
      }
    }
  }, /*elastic=*/true);
}

// linear_heads_bfbf for T (1 or 2: heads_path) rows, out float32 or bf16 (BF).
template <bool BF>
static void linear_heads_rows(Pool* P, const void* W, int B, int N, int K, const void* x, int T,
                              void* out) {
  if (T == 1)
    linear_heads_bfbf<1, BF>(P, (const uint16_t*)W, B, N, K, (const uint16_t*)x, out);
  else
    linear_heads_bfbf<2, BF>(P, (const uint16_t*)W, B, N, K, (const uint16_t*)x, out);
}
}  // extern "C++"
#endif

// k2_linear_batched's per-head decode path (bf16 x bf16, several matrices, T <= 2)?
static bool heads_path(int wfmt, int x_dtype, int B, int T) {
  return K2_HAS_I4BF && !K2_HEADS_LEGACY && wfmt == FMT_BF16 && x_dtype == X_BF16 && B > 1 &&
         T <= 2;
}

// out [T, B, N] float32 = per b: x [T, b, K] @ W[b][N, K]^T for dense bf16 / float32 weights
// W [B, N, K] (decode-sized T; B = 1: one linear layer, B = heads: the absorbed MLA weights):
// (b, block of 32 rows) items over the pool's threads, tokens in blocks of 8 (each weight row is
// read once per 8 tokens). bf16 x bf16 uses vdpbf16ps; other pairs the float32 path. Returns 0,
// or 2 when the shape is not supported (K % 32).
int k2_linear_batched(void* pool, int wfmt, const void* W, int B, int N, int K, const void* x,
                      int x_dtype, int T, float* out) {
  if (K % 32 != 0 || B < 1 || (wfmt != FMT_BF16 && wfmt != FMT_F32)) return 2;
  Pool* P = (Pool*)pool;
  std::lock_guard<std::mutex> call(P->call_mu);
  const int64_t wb = (int64_t)N * K * (wfmt == FMT_F32 ? 4 : 2);  // bytes per weight matrix
  std::vector<Mat> ms(B);
  for (int b = 0; b < B; ++b) mk_mat(ms[b], wfmt, (int64_t)W + b * wb, 0, K);
  const bool bfbf = K2_HAS_I4BF && wfmt == FMT_BF16 && x_dtype == X_BF16;
#if K2_HAS_I4BF
  if (heads_path(wfmt, x_dtype, B, T)) {  // per-head decode rows: 16 sums per reduction
    linear_heads_rows<false>(P, W, B, N, K, x, T, out);
    return 0;
  }
#endif
  static thread_local std::vector<float> xf_tl;
  std::vector<float>& xf = xf_tl;
  const int64_t xn = (int64_t)T * B * K;
  if (!bfbf) {  // activations as float32 (small: decode-sized T)
    xf.resize(xn);
    for (int64_t i = 0; i < xn; ++i)
      xf[i] = x_dtype == X_BF16 ? bf16_to_f32(((const uint16_t*)x)[i]) : ((const float*)x)[i];
  }
  // rows per item: 32, fewer (a multiple of 4, at least 8) where that leaves a thread fewer
  // than K2_LINEAR_PER_THREAD items: a call ends when its last item does, so on 16 threads the
  // fused q_a + kv_a (2,112 rows: 66 items of 32 = 4.1 a thread) or gate_up (4,096 rows: 8 a
  // thread) waited up to a whole 458 KB item on the slowest thread (K2_BFBF_PF_LEGACY=1: 32)
  const int64_t want = (int64_t)K2_LINEAR_PER_THREAD * P->nthreads;
  const int RB = K2_BFBF_PF_LEGACY || !bfbf
                     ? 32
                     : (int)std::max<int64_t>(8, std::min<int64_t>(32, (int64_t)N * B / want) & ~3);
  const int64_t per_b = (N + RB - 1) / RB, items = per_b * B;
  std::atomic<int64_t> next{0};
  // bf16 x bf16: a thread claims its next item before it reads the current one's last rows,
  // and prefetches that item's rows there (dot_block's `next`): its stream does not restart
  // cold at every item (K2_BFBF_PF_LEGACY=1: claimed when the current one is done)
  const bool ahead = bfbf && !K2_BFBF_PF_LEGACY;
  P->run([&](int, int) {
    float y[32 * 8];
    int64_t it = next.fetch_add(1, std::memory_order_relaxed);
    for (;;) {
      if (it >= items) break;
      const int64_t nit = ahead ? next.fetch_add(1, std::memory_order_relaxed) : items;
      const int b = it / per_b;
      const Mat& m = ms[b];
      int r0 = (it % per_b) * RB, r1 = std::min<int64_t>(N, r0 + RB);
      const Mat* nm = nit < items ? &ms[nit / per_b] : nullptr;
      const int nr0 = nit < items ? (int)(nit % per_b) * RB : 0;
      for (int t0 = 0; t0 < T; t0 += 8) {
        int nt = std::min(8, T - t0);
        const void* xs[8];
        for (int t = 0; t < nt; ++t) {
          const int64_t off = ((int64_t)(t0 + t) * B + b) * K;
          xs[t] = bfbf ? (const void*)((const uint16_t*)x + off) : (const void*)(xf.data() + off);
        }
#if K2_HAS_I4BF
        if (bfbf)
          dot_block<FMT_BFBF>(m, r0, r1 - r0, xs, nullptr, nt, y, t0 + 8 >= T ? nm : nullptr, nr0);
        else
#endif
        if (wfmt == FMT_BF16)
          dot_block<FMT_BF16>(m, r0, r1 - r0, xs, nullptr, nt, y);
        else
          dot_block<FMT_F32>(m, r0, r1 - r0, xs, nullptr, nt, y);
        for (int t = 0; t < nt; ++t) {
          float* o = out + ((int64_t)(t0 + t) * B + b) * N;
          for (int r = r0; r < r1; ++r) o[r] = y[(r - r0) * 8 + t];
        }
      }
      it = ahead ? nit : next.fetch_add(1, std::memory_order_relaxed);
    }
  }, /*elastic=*/true);  // items from a counter: a late thread finds them taken
  return 0;
}

// out [T, N] float32 = x [T, K] @ W[N, K]^T for a dense bf16 / float32 weight (one matrix).
int k2_linear(void* pool, int wfmt, const void* W, int N, int K, const void* x, int x_dtype,
              int T, float* out) {
  return k2_linear_batched(pool, wfmt, W, 1, N, K, x, x_dtype, T, out);
}

// k2_linear_batched with out [T, B, N] in out_dtype (X_F32 or X_BF16: rounded to nearest even
// by the per-head path's threads, else after the float32 call). Returns as k2_linear_batched.
int k2_linear_batched_out(void* pool, int wfmt, const void* W, int B, int N, int K, const void* x,
                          int x_dtype, int T, void* out, int out_dtype) {
  if (out_dtype != X_BF16) return k2_linear_batched(pool, wfmt, W, B, N, K, x, x_dtype, T, (float*)out);
#if K2_HAS_I4BF
  if (K % 32 == 0 && heads_path(wfmt, x_dtype, B, T)) {
    Pool* P = (Pool*)pool;
    std::lock_guard<std::mutex> call(P->call_mu);
    linear_heads_rows<true>(P, W, B, N, K, x, T, out);
    return 0;
  }
#endif
  static thread_local std::vector<float> acc_tl;
  const int64_t n = (int64_t)T * B * N;
  acc_tl.resize(n);
  int rc = k2_linear_batched(pool, wfmt, W, B, N, K, x, x_dtype, T, acc_tl.data());
  if (rc == 0) rows_to_bf16(acc_tl.data(), (uint16_t*)out, 1, (int)n, 0, (int)n);
  return rc;
}

int k2_simd_width() {
#if defined(__AVX512F__)
  return 512;
#elif defined(__AVX2__)
  return 256;
#else
  return 128;
#endif
}

}  // extern "C"

// The noaux_tc router at decode: the gate's GEMV above + the grouped top-k (k2_router_topk).
#include "k2router.h"
// A decode step's logits on the calling thread: the widening to float32, the greedy argmax.
#include "k2logits.h"
