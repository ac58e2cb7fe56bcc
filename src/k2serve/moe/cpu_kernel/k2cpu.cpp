// k2serve CPU expert kernel: all CPU-resident routed experts of one MoE layer for one step in
// one call, reading the weights in their checkpoint format at the DRAM limit.
//
// Built on first use by k2serve.moe.cpu_kernel (g++ -O3 -march=native -shared), loaded through
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
//   1. x -> float32 (permuted for INT4), threads split over tokens;
//   2. gate+up: work items (expert, block of intermediate rows); the same thread computes the
//      gate and up rows for all tokens routed to that expert (each weight row unpacked once
//      per group of <= 8 tokens), writes h = silu(g) * u in the layout down_proj reads;
//   3. down: work items = blocks of output rows; each item loops over the active experts and
//      accumulates weight * (down_e @ h) into its own rows (no atomics);
//   4. with several NUMA nodes, node n's threads compute its share of every expert's gate/up
//      rows (intermediate dim split) and, after one barrier over all threads, its share of the
//      output rows of down_proj (hidden dim split); those row ranges are moved to node n's
//      memory at load (k2_layer_bind, mbind). Each row is computed exactly as on one node, so
//      the result is bit-identical to a one-node run; no partial sums to add.
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define K2_PAUSE() _mm_pause()
#else
#define K2_PAUSE() ((void)0)
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef uint16_t v16s __attribute__((vector_size(32)));
typedef _Float16 v16h __attribute__((vector_size(32)));

enum { FMT_INT4 = 0, FMT_FP8 = 1, FMT_BF16 = 2, FMT_F32 = 3 };
enum { X_F32 = 0, X_BF16 = 1 };

static inline v16f loadf(const float* p) {
  v16f v;
  memcpy(&v, p, 64);
  return v;
}
static inline void storef(float* p, v16f v) { memcpy(p, &v, 64); }
static inline float hsum(v16f v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}
static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline v16f splat(float f) { return (v16f){} + f; }

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

template <>
struct Deq<FMT_INT4> {
  static inline void load(const Mat& m, int r, int c, v16f& lo, v16f& hi) {
    const uint8_t* p = m.w + (int64_t)r * m.row_bytes + (int64_t)c * 16;
    v16b b;
    memcpy(&b, p, 16);
    v16i q = __builtin_convertvector(b, v16i);
    float s = bf16_to_f32(((const uint16_t*)m.s)[(int64_t)r * m.s_cols + c]);
    v16f vs = splat(s), vo = splat(-8.f * s);
    lo = __builtin_convertvector(q & 15, v16f) * vs + vo;
    hi = __builtin_convertvector(q >> 4, v16f) * vs + vo;
  }
};

static inline v16f fp8x16(const uint8_t* p) {
  v16b b;
  memcpy(&b, p, 16);
  v16s w = __builtin_convertvector(b, v16s);
  v16s h = (v16s)(((w & 0x7F) << 7) | ((w & 0x80) << 8));
  v16h hf;
  memcpy(&hf, &h, 32);
  return __builtin_convertvector(hf, v16f);
}

template <>
struct Deq<FMT_FP8> {
  static inline void load(const Mat& m, int r, int c, v16f& lo, v16f& hi) {
    const uint8_t* p = m.w + (int64_t)r * m.row_bytes + (int64_t)c * 32;
    // e4m3 bits placed in fp16 are 2^-8 of the value: fold 256 into the block scale
    float s = 256.f * ((const float*)m.s)[(int64_t)(r >> 7) * m.s_cols + (c >> 2)];
    v16f vs = splat(s);
    lo = fp8x16(p) * vs;
    hi = fp8x16(p + 16) * vs;
  }
};

static inline v16f bf16x16(const uint8_t* p) {
  v16s b;
  memcpy(&b, p, 32);
  v16u u = __builtin_convertvector(b, v16u) << 16;
  v16f f;
  memcpy(&f, &u, 64);
  return f;
}

template <>
struct Deq<FMT_BF16> {
  static inline void load(const Mat& m, int r, int c, v16f& lo, v16f& hi) {
    const uint8_t* p = m.w + (int64_t)r * m.row_bytes + (int64_t)c * 64;
    lo = bf16x16(p);
    hi = bf16x16(p + 32);
  }
};

template <>
struct Deq<FMT_F32> {
  static inline void load(const Mat& m, int r, int c, v16f& lo, v16f& hi) {
    const float* p = (const float*)(m.w + (int64_t)r * m.row_bytes) + c * 32;
    lo = loadf(p);
    hi = loadf(p + 16);
  }
};

// out[i * NT + t] = dot(row r0 + i of m, xs[t]) for i < R, t < NT. xs in the chunk layout
// (for INT4: per 32-column chunk, the 16 even columns then the 16 odd ones).
template <int FMT, int R, int NT>
static inline void dot_rows(const Mat& m, int r0, const float* const* xs, float* out) {
  v16f acc_lo[R][NT], acc_hi[R][NT];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) acc_lo[i][t] = acc_hi[i][t] = (v16f){};
  const int chunks = m.cols >> 5;
  for (int c = 0; c < chunks; ++c) {
    v16f lo[R], hi[R];
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

// rows [r0, r0 + nrows) x nt tokens (nt <= 8): out[i * 8 + t]
template <int FMT>
static void dot_block(const Mat& m, int r0, int nrows, const float* const* xs, int nt,
                      float* out) {
  int i = 0;
  switch (nt) {
#define K2_CASE(NT, R)                                                  \
  case NT:                                                              \
    for (; i + R <= nrows; i += R) {                                    \
      float tmp[R * NT];                                                \
      dot_rows<FMT, R, NT>(m, r0 + i, xs, tmp);                         \
      for (int a = 0; a < R; ++a)                                       \
        for (int t = 0; t < NT; ++t) out[(i + a) * 8 + t] = tmp[a * NT + t]; \
    }                                                                   \
    for (; i < nrows; ++i) {                                            \
      float tmp[NT];                                                    \
      dot_rows<FMT, 1, NT>(m, r0 + i, xs, tmp);                         \
      for (int t = 0; t < NT; ++t) out[i * 8 + t] = tmp[t];             \
    }                                                                   \
    break;
    K2_CASE(1, 4)
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
// Thread pool: threads grouped by NUMA node; a job runs fn(node, rank in node) on every thread
// (the calling thread is rank 0 of node 0). Workers spin briefly, then sleep.
struct Pool {
  int nthreads = 1;
  int nnodes = 1;
  std::vector<int> node_of, rank_of, node_size;
  std::vector<std::thread> threads;
  std::mutex mu;
  std::mutex call_mu;  // one k2_* call at a time per pool
  std::condition_variable cv;
  std::atomic<uint64_t> gen{0};
  std::atomic<int> pending{0};
  std::function<void(int, int)> job;
  bool stop = false;
  int spin = 20000;
  // per-node work counters
  struct alignas(64) NodeSync {
    std::atomic<int64_t> next{0};
  };
  std::vector<NodeSync> sync;

  void worker(int tid, int cpu_first, const std::vector<int>& cpus) {
    if (!cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int c : cpus) CPU_SET(c, &set);
      pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    }
    (void)cpu_first;
    uint64_t seen = 0;
    for (;;) {
      uint64_t g;
      int n = 0;
      while ((g = gen.load(std::memory_order_acquire)) == seen && n < spin) {
        K2_PAUSE();
        ++n;
      }
      if (g == seen) {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return stop || gen.load(std::memory_order_acquire) != seen; });
        if (stop) return;
        g = gen.load(std::memory_order_acquire);
      }
      seen = g;
      job(node_of[tid], rank_of[tid]);
      pending.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  void run(std::function<void(int, int)> fn) {
    job = std::move(fn);
    pending.store(nthreads - 1, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lk(mu);
      gen.fetch_add(1, std::memory_order_acq_rel);
    }
    cv.notify_all();
    job(node_of[0], rank_of[0]);
    while (pending.load(std::memory_order_acquire) != 0) K2_PAUSE();
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = true;
      gen.fetch_add(1);
    }
    cv.notify_all();
    for (auto& t : threads) t.join();
  }
};

// ---------------------------------------------------------------------------------------------
struct Layer {
  int fmt, E, H, I;
  std::vector<Mat> gate, up, down;  // [E] local experts
};

struct Scratch {
  std::vector<float> x;  // [T, H] float32 (permuted for INT4)
  std::vector<float> h;  // [P, I] float32, in down_proj's input layout
  std::vector<int> pair_tok, expert_start, active;
  std::vector<float> pair_w;
};

static const int RB1 = 16;  // gate/up rows per work item
static const int RB2 = 16;  // down rows per work item

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
                         const float* xs_base, float* h_base, int slot0) {
  const Mat& G = L->gate[e];
  const Mat& U = L->up[e];
  const int H = L->H, I = L->I;
  float g[RB1 * 8], u[RB1 * 8];
  for (int t0 = 0; t0 < m; t0 += 8) {
    int nt = std::min(8, m - t0);
    const float* xs[8];
    for (int t = 0; t < nt; ++t) xs[t] = xs_base + (int64_t)toks[t0 + t] * H;
    dot_block<FMT>(G, i0, i1 - i0, xs, nt, g);
    dot_block<FMT>(U, i0, i1 - i0, xs, nt, u);
    for (int i = i0; i < i1; ++i) {
      int pos = i;  // where intermediate index i sits in down_proj's input layout
      if (FMT == FMT_INT4) {
        int c = i & 31;
        pos = (i & ~31) + ((c & 1) ? 16 + (c >> 1) : (c >> 1));
      }
      for (int t = 0; t < nt; ++t) {
        float gv = g[(i - i0) * 8 + t], uv = u[(i - i0) * 8 + t];
        h_base[(int64_t)(slot0 + t0 + t) * I + pos] = gv / (1.f + std::exp(-gv)) * uv;
      }
    }
  }
}

template <int FMT>
static void down_item(const Layer* L, const Scratch& sc, int o0, int o1, float* out) {
  const int H = L->H, I = L->I;
  float y[RB2 * 8];
  for (int e : sc.active) {
    int p0 = sc.expert_start[e], p1 = sc.expert_start[e + 1];
    for (int q0 = p0; q0 < p1; q0 += 8) {
      int nt = std::min(8, p1 - q0);
      const float* hs[8];
      for (int t = 0; t < nt; ++t) hs[t] = sc.h.data() + (int64_t)(q0 + t) * I;
      dot_block<FMT>(L->down[e], o0, o1 - o0, hs, nt, y);
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
      while (phase.load(std::memory_order_acquire) == ph) K2_PAUSE();
    }
  }
};

template <int FMT>
static void forward_impl(Layer* L, Pool* P, Scratch& sc, const float* xf, float* out) {
  const int I = L->I, H = L->H, nn = P->nnodes;
  const int Pn = sc.pair_tok.size();
  if (sc.h.size() < (size_t)Pn * I) sc.h.resize((size_t)Pn * I);
  float* hb = sc.h.data();
  const int A = sc.active.size();
  for (int n = 0; n < nn; ++n) P->sync[n].next.store(0);
  AllBarrier bar;
  P->run([&](int node, int rank) {
    (void)rank;
    Pool::NodeSync& s = P->sync[node];
    // phase 1: this node's rows of every active expert's gate + up
    int r0, r1;
    node_range(P, node, I, 32, r0, r1);
    const int nb = (r1 - r0 + RB1 - 1) / RB1;
    const int64_t items1 = (int64_t)A * nb;
    for (;;) {
      int64_t it = s.next.fetch_add(1, std::memory_order_relaxed);
      if (it >= items1) break;
      int e = sc.active[it / nb];
      int i0 = r0 + (int)(it % nb) * RB1, i1 = std::min(r1, i0 + RB1);
      int p0 = sc.expert_start[e], p1 = sc.expert_start[e + 1];
      gate_up_item<FMT>(L, e, i0, i1, sc.pair_tok.data() + p0, p1 - p0, xf, hb, p0);
    }
    bar.wait(P->nthreads);
    if (rank == 0) s.next.store(0, std::memory_order_release);
    bar.wait(P->nthreads);
    // phase 2: this node's output rows, each row block owned by one thread
    int o0n, o1n;
    node_range(P, node, H, RB2, o0n, o1n);
    const int64_t items2 = (o1n - o0n + RB2 - 1) / RB2;
    for (;;) {
      int64_t it = s.next.fetch_add(1, std::memory_order_relaxed);
      if (it >= items2) break;
      int o0 = o0n + (int)it * RB2, o1 = std::min(o1n, o0 + RB2);
      down_item<FMT>(L, sc, o0, o1, out);
    }
  });
}

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
    p->threads.emplace_back([p, t, cpus] { p->worker(t, 0, cpus); });
  }
  return p;
}

void k2_pool_destroy(void* p) { delete (Pool*)p; }

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
// local_of [num_global] int32 (-1: not an expert of this layer object), out [T, H] float32
// (overwritten; rows of tokens without a local expert are zero). Returns 0, or 1 when an
// expert id is outside [0, num_global) (nothing is computed then).
int k2_moe_forward(void* layer, void* pool, int T, int k, const void* x, int x_dtype,
                   const int64_t* ids, const float* w, const int32_t* local_of, int num_global,
                   float* out, void* unused) {
  (void)unused;
  Layer* L = (Layer*)layer;
  Pool* P = (Pool*)pool;
  const int H = L->H, E = L->E;
  std::lock_guard<std::mutex> call(P->call_mu);
  static thread_local Scratch sc;
  // 0. bucket the (token, expert) pairs by local expert (a repeated id makes two pairs)
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
  // 1. zero the output, x -> float32 in the weights' column order (threads split over rows)
  if (sc.x.size() < (size_t)T * H) sc.x.resize((size_t)T * H);
  float* xf = sc.x.data();
  const int fmt = L->fmt;
  std::atomic<int> next{0};
  P->run([&](int, int) {
    for (;;) {
      int t = next.fetch_add(1);
      if (t >= T) break;
      memset(out + (int64_t)t * H, 0, sizeof(float) * H);
      float* dst = xf + (int64_t)t * H;
      float row[32];
      for (int c = 0; c < H; c += 32) {
        if (x_dtype == X_BF16) {
          const uint16_t* src = (const uint16_t*)x + (int64_t)t * H + c;
          for (int j = 0; j < 32; ++j) row[j] = bf16_to_f32(src[j]);
        } else {
          memcpy(row, (const float*)x + (int64_t)t * H + c, sizeof(row));
        }
        if (fmt == FMT_INT4) {
          for (int j = 0; j < 16; ++j) {
            dst[c + j] = row[2 * j];
            dst[c + 16 + j] = row[2 * j + 1];
          }
        } else {
          memcpy(dst + c, row, sizeof(row));
        }
      }
    }
  });
  if (Pn == 0) return 0;
  // 2, 3. gate + up, then down
  if (fmt == FMT_INT4)
    forward_impl<FMT_INT4>(L, P, sc, xf, out);
  else if (fmt == FMT_FP8)
    forward_impl<FMT_FP8>(L, P, sc, xf, out);
  else if (fmt == FMT_BF16)
    forward_impl<FMT_BF16>(L, P, sc, xf, out);
  else
    forward_impl<FMT_F32>(L, P, sc, xf, out);
  return 0;
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
