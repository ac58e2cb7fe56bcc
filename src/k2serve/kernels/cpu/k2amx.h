// k2serve CPU expert kernel, prompt path: the expert GEMMs on AMX tiles (bf16 x bf16 -> f32).
// Included by k2cpu.cpp after its Mat / Layer / Scratch / Pool definitions (one translation
// unit: the kernel is built from k2cpu.cpp alone; the build key hashes this file too).
//
// Used for steps with many tokens per expert (prompts): the decode path (k2cpu.cpp's dot
// products) reads each weight once per 8 tokens and is compute-bound at prompt sizes; here each
// weight row is dequantized once per call into bf16 in L2 and multiplied on the tile unit.
//
// Operands (all tiles 16 rows x 64 bytes, one palette-1 configuration for tiles 0-7):
//   A = 16 weight rows x 32 input columns (one quantization group), dequantized by AVX-512 into
//       a per-thread buffer [group][2 tiles][16 rows][32] bf16. INT4: a group's 16 bytes give 16
//       low nibbles (columns 0, 2, .., 30) then 16 high nibbles (1, 3, .., 31): A's column order
//       is that, not the natural one (no permute); FP8 / BF16: natural order. Each weight is
//       s * (q - 8) (INT4) or e4m3 * scale (FP8) rounded once to bf16 (the decode path keeps
//       them exact in float32; the difference is within the bf16 budget).
//   B = the activations of 16 (token, expert) pairs of one expert for the same 32 columns, in
//       the tile unit's pair layout (row p holds A's columns 2p and 2p + 1 for each pair):
//       built once per call per expert (xt, for gate/up), and written directly in that layout
//       by gate/up for down (ht). Pairs past an expert's count are zero columns.
//   C = 16 weight rows x 16 pairs, float32; 2 A tiles x 2 B tiles = 4 accumulators.
// Work: gate/up items = (expert, RBT1 rows of the intermediate dim): 16 gate + 16 up rows
// dequantized, then every pair tile of the expert; h = silu(g) * u rounded to bf16 into ht.
// Down items = a block of output rows (2 per thread), looping over the active experts (each
// row owned by one thread, no atomics), 32 rows dequantized at a time. NUMA: the same node row
// split as the decode path.
//
// Availability: compiled when -march=native gives AMX-TILE + AMX-BF16 (with AVX512-BF16 for the
// dequantization), used when Linux grants the process the tile state (arch_prctl); otherwise
// k2_layer_set_tiles reports 0 and every step takes the decode path (AVX-512 / AVX2 machines).
#include <stdlib.h>

#if K2_HAS_I4BF && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define K2_HAS_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define K2_HAS_AMX 0
#endif

// Shared with the MLA decode kernel (k2mla.h), which also runs on AVX512-BF16 without AMX.
#if K2_HAS_I4BF
static const int TILE_ELEMS = 512;  // bf16 elements in one 16 x 64-byte tile

// 64-byte aligned growable buffer of bf16 words
struct TileBuf {
  uint16_t* p = nullptr;
  size_t n = 0;
  uint16_t* get(size_t need) {
    if (need > n) {
      free(p);
      p = (uint16_t*)aligned_alloc(64, ((need * 2 + 63) / 64) * 64);
      n = need;
    }
    return p;
  }
  ~TileBuf() { free(p); }
};

// r[c][p] -> r[p][c] for a 16 x 16 matrix of dwords
static K2_INLINE void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

// e^x for |x| <= 88 (the result is clamped beyond): 2^(x log2 e) split into an integer part
// (scalef) and a degree-7 polynomial on [-0.5, 0.5] (relative error ~1e-7)
static K2_INLINE __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.f)), _mm512_set1_ps(88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif  // K2_HAS_I4BF

// 1 when this process may use the tile unit (asks Linux once per process)
static bool amx_permitted() {
#if K2_HAS_AMX
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /*ARCH_REQ_XCOMP_PERM*/,
                                 18 /*XFEATURE_XTILEDATA*/) == 0;
  return ok;
#else
  return false;
#endif
}

#if K2_HAS_AMX

struct TileScratch {
  TileBuf xt, ht;                 // [tiles][groups][512] bf16: B operands of gate/up, down
  std::vector<int> tile_start;    // [E + 1] first pair tile of each local expert
  std::vector<int> tile_expert;   // [tiles] the expert of each pair tile
};

static void tile_config() {
  alignas(64) uint8_t cfg[64] = {};
  cfg[0] = 1;  // palette 1
  for (int t = 0; t < 8; ++t) {
    ((uint16_t*)(cfg + 16))[t] = 64;  // bytes per row
    cfg[48 + t] = 16;                 // rows
  }
  _tile_loadconfig(cfg);
}

// Position of column j (0..31) of a group in A's column order.
template <int FMT>
static inline int tile_pos(int j) {
  return FMT == FMT_INT4 ? ((j & 1) ? 16 + (j >> 1) : (j >> 1)) : j;
}

// Weight bytes prefetched ahead (into L2) by the dequantization: one thread streams one row at
// a time, so the distance sets the bytes it has in flight.
#ifndef K2_AMX_PF
#define K2_AMX_PF 4096
#endif
static K2_INLINE void prefetch_l2(const void* p) {
  if (K2_AMX_PF > 0) _mm_prefetch((const char*)p + K2_AMX_PF, _MM_HINT_T1);
}

// Row r of m, groups [g0, g0 + ng), as bf16 in A's column order: group g at
// dst + (g - g0) * stride.
template <int FMT>
static K2_INLINE void deq_row_bf16(const Mat& m, int r, int g0, int ng, uint16_t* dst,
                                   int64_t stride) {
  const int groups = g0 + ng;
  const uint8_t* row = m.w + (int64_t)r * m.row_bytes;
  dst -= g0 * stride;
  if constexpr (FMT == FMT_INT4) {
    // per group a 32-entry table of s * (v - 8) in bf16 (v = 0..15, twice), indexed by the
    // nibbles: lanes 0-15 take the 16 bytes (vpermw reads the low 5 bits: entry lo or 16 + lo),
    // lanes 16-31 the bytes shifted right by 4 (the high nibbles)
    const uint16_t* sp = (const uint16_t*)m.s + (int64_t)r * m.s_cols;
    const __m512 vals = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    alignas(64) float sf[16];
    for (int g = g0; g < groups; ++g) {
      if (((g - g0) & 15) == 0) {  // 16 scales to float32 at once
        const int n = std::min(16, groups - g);
        __m256i b = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1u), sp + g);
        _mm512_store_ps(sf, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
      }
      if ((g & 3) == 0) prefetch_l2(row + g * 16);
      const __m512 f = _mm512_mul_ps(_mm512_set1_ps(sf[(g - g0) & 15]), vals);
      const __m512i lut = (__m512i)_mm512_cvtne2ps_pbh(f, f);
      const __m128i b = _mm_loadu_si128((const __m128i*)(row + g * 16));
      const __m256i b2 = _mm256_broadcastsi128_si256(b);
      const __m512i idx = _mm512_srlv_epi16(_mm512_cvtepu8_epi16(b2), shift);
      _mm512_store_si512(dst + g * stride, _mm512_permutexvar_epi16(idx, lut));
    }
  } else if constexpr (FMT == FMT_FP8) {
    const float* sp = (const float*)m.s + (int64_t)(r >> 7) * m.s_cols;
    for (int g = g0; g < groups; ++g) {
      if ((g & 1) == 0) prefetch_l2(row + g * 32);
      __m512 s = _mm512_set1_ps(256.f * sp[g >> 2]);
      __m512 lo = _mm512_mul_ps((__m512)fp8x16(row + g * 32), s);
      __m512 hi = _mm512_mul_ps((__m512)fp8x16(row + g * 32 + 16), s);
      _mm512_store_si512(dst + g * stride, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  } else {  // BF16
    for (int g = g0; g < groups; ++g) {
      prefetch_l2(row + g * 64);
      _mm512_store_si512(dst + g * stride, _mm512_loadu_si512(row + g * 64));
    }
  }
}

// C (4 x [16][16] float, in memory) += A0, A1 (abuf: per group 2 tiles) x B0, B1 (per group
// one tile) over `groups`; c[0] = A0 B0, c[1] = A1 B0, c[2] = A0 B1, c[3] = A1 B1 (b1 ==
// nullptr: B0 only). `first`: C starts at zero instead of being loaded.
static void amx_acc(const uint16_t* abuf, const uint16_t* b0, const uint16_t* b1, int groups,
                    float* c, bool first) {
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
  } else {
    _tile_loadd(0, c, 64);
    _tile_loadd(1, c + 256, 64);
  }
  if (b1) {
    if (first) {
      _tile_zero(2);
      _tile_zero(3);
    } else {
      _tile_loadd(2, c + 512, 64);
      _tile_loadd(3, c + 768, 64);
    }
    for (int g = 0; g < groups; ++g) {
      _tile_loadd(4, abuf + (int64_t)g * 2 * TILE_ELEMS, 64);
      _tile_loadd(5, abuf + (int64_t)g * 2 * TILE_ELEMS + TILE_ELEMS, 64);
      _tile_loadd(6, b0 + (int64_t)g * TILE_ELEMS, 64);
      _tile_loadd(7, b1 + (int64_t)g * TILE_ELEMS, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
  } else {
    for (int g = 0; g < groups; ++g) {
      _tile_loadd(4, abuf + (int64_t)g * 2 * TILE_ELEMS, 64);
      _tile_loadd(5, abuf + (int64_t)g * 2 * TILE_ELEMS + TILE_ELEMS, 64);
      _tile_loadd(6, b0 + (int64_t)g * TILE_ELEMS, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
    }
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
}

// One block of 32 weight rows (A0 = rows of m0 from r0, A1 = rows of m1 from r1) times every
// pair tile [tb, te) of one expert (B tiles `groups` x 512 bf16 each, from b): K in steps of
// KB groups, each step's A dequantized into abuf (L1) and used by every tile pair; C in c
// ([pairs of tiles][4][256] float).
// Groups per K step (0: all of K at once). The lent Xeon (2 MB L2 per core, 2,048-token K2
// layer): whole K 390 ms, 8 groups 499 ms, 16 groups 511 ms: short steps read 32 weight rows
// 128 bytes at a time, which the prefetchers do not follow; a whole row streams.
#ifndef K2_AMX_KB
#define K2_AMX_KB 0
#endif
static const int KB = K2_AMX_KB;

template <int FMT>
static void amx_rows(const Mat& m0, int r0, const Mat& m1, int r1, const uint16_t* b, int ntiles,
                     int groups, uint16_t* abuf, float* c) {
  const int kb = KB > 0 ? KB : groups;
  for (int g0 = 0; g0 < groups; g0 += kb) {
    const int ng = std::min(kb, groups - g0);
    for (int n = 0; n < 16; ++n) {
      deq_row_bf16<FMT>(m0, r0 + n, g0, ng, abuf + n * 32, 2 * TILE_ELEMS);
      deq_row_bf16<FMT>(m1, r1 + n, g0, ng, abuf + TILE_ELEMS + n * 32, 2 * TILE_ELEMS);
    }
    for (int t = 0; t < ntiles; t += 2) {
      const uint16_t* bt = b + ((int64_t)t * groups + g0) * TILE_ELEMS;
      amx_acc(abuf, bt, t + 1 < ntiles ? bt + (int64_t)groups * TILE_ELEMS : nullptr, ng,
              c + (int64_t)(t / 2) * 1024, g0 == 0);
    }
  }
}


// B tile `tile` (pairs q0 .. q0 + 15 of one expert, `valid` of them real) of x: per group g,
// row p = the dwords of A's columns 2p, 2p + 1 for each pair (a 16 x 16 dword transpose of the
// pairs' permuted activations).
template <int FMT>
static void build_xt(const uint16_t* x, int H, const int* pair_tok, int valid, uint16_t* dst) {
  const int groups = H >> 5;
  alignas(64) int16_t idx[32];
  for (int l = 0; l < 32; ++l)  // lane l of the permuted vector = A's column l
    idx[l] = FMT == FMT_INT4 ? (l < 16 ? 2 * l : 2 * (l - 16) + 1) : l;
  const __m512i perm = _mm512_load_si512(idx);
  const uint16_t* xr[16];
  for (int c = 0; c < 16; ++c) xr[c] = c < valid ? x + (int64_t)pair_tok[c] * H : nullptr;
  for (int g = 0; g < groups; ++g) {
    __m512i r[16];
    for (int c = 0; c < 16; ++c)
      r[c] = xr[c] ? _mm512_permutexvar_epi16(perm, _mm512_loadu_si512(xr[c] + g * 32))
                   : _mm512_setzero_si512();
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_store_si512(dst + (int64_t)g * TILE_ELEMS + p * 32, r[p]);
  }
}


// silu(g) * u for 16 pairs (zero past `valid`)
static K2_INLINE __m512 silu_mul(const float* g, const float* u, __mmask16 valid) {
  const __m512 gv = _mm512_load_ps(g);
  const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), e);
  return _mm512_maskz_mul_ps(valid, _mm512_div_ps(gv, d), _mm512_load_ps(u));
}

// h = silu(g) * u for one C pair (rows i0 .. i0 + 15 of the intermediate dim, i0 a multiple of
// 16, 16 pairs, `valid` real), written into ht's tile in down's B layout (zeros for padding).
// The rows pair up into B's dwords: A columns 2p, 2p + 1 are rows j, j + 2 (INT4, j % 4 < 2)
// or j, j + 1 (natural order, j even) of the group.
template <int FMT>
static void write_h(const float* cg, const float* cu, int i0, int valid, uint16_t* ht_tile) {
  const __mmask16 vm = (__mmask16)((1u << valid) - 1u);
  alignas(64) int16_t idx[32];
  for (int l = 0; l < 32; ++l) idx[l] = (l & 1) ? 16 + (l >> 1) : (l >> 1);  // interleave
  const __m512i inter = _mm512_load_si512(idx);
  const int step = FMT == FMT_INT4 ? 2 : 1;
  for (int n = 0; n < 16; ++n) {
    const int j = (i0 + n) & 31;
    if (FMT == FMT_INT4 ? (j & 2) != 0 : (j & 1) != 0) continue;  // the second row of a pair
    const __m512 a = silu_mul(cg + n * 16, cu + n * 16, vm);
    const __m512 b = silu_mul(cg + (n + step) * 16, cu + (n + step) * 16, vm);
    const __m512i ab = _mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    const int jp = tile_pos<FMT>(j);  // even
    _mm512_store_si512(ht_tile + (int64_t)((i0 + n) >> 5) * TILE_ELEMS + (jp >> 1) * 32, ab);
  }
}

// Gate/up rows per work item (16 at a time): an item reads its expert's B tiles (xt) once
// into L2. Down: items per thread of its node (32 rows at a time; each expert's ht read once
// per item).
#ifndef K2_AMX_RB1
#define K2_AMX_RB1 256
#endif
#ifndef K2_AMX_DOWN_SPLIT
#define K2_AMX_DOWN_SPLIT 2
#endif
static const int RBT1 = K2_AMX_RB1;

template <int FMT>
static void forward_tiles(Layer* L, Pool* P, Scratch& sc, int T, const uint16_t* x, float* out) {
  static thread_local TileScratch ts_tl;
  TileScratch& ts = ts_tl;
  const int H = L->H, I = L->I, G1 = H >> 5, G2 = I >> 5, E = L->E;
  ts.tile_start.assign(E + 1, 0);
  for (int e = 0; e < E; ++e)
    ts.tile_start[e + 1] =
        ts.tile_start[e] + (sc.expert_start[e + 1] - sc.expert_start[e] + 15) / 16;
  const int ntiles = ts.tile_start[E];
  int max_tiles = 0;
  for (int e = 0; e < E; ++e)
    max_tiles = std::max(max_tiles, ts.tile_start[e + 1] - ts.tile_start[e]);
  ts.tile_expert.resize(ntiles);
  for (int e = 0; e < E; ++e)
    for (int t = ts.tile_start[e]; t < ts.tile_start[e + 1]; ++t) ts.tile_expert[t] = e;
  uint16_t* xt = ts.xt.get((size_t)ntiles * G1 * TILE_ELEMS);
  uint16_t* ht = ts.ht.get((size_t)ntiles * G2 * TILE_ELEMS);
  const int A = sc.active.size(), nn = P->nnodes;
  for (int n = 0; n < nn; ++n) P->sync[n].next.store(0);
  std::atomic<int> next_row{0}, next_tile{0};
  AllBarrier bar;
  const double t_run = now_s();
  double t_in = 0, t_pro = 0, t_gu = 0;
  P->run([&](int node, int rank) {
    Pool::NodeSync& s = P->sync[node];
    const bool caller = node == 0 && rank == 0;
    if (caller) t_in = now_s();
    tile_config();
    static thread_local TileBuf abuf_tl, c_tl;
    uint16_t* abuf = abuf_tl.get((size_t)(KB > 0 ? KB : std::max(G1, G2)) * 2 * TILE_ELEMS);
    float* c = (float*)c_tl.get((size_t)(max_tiles + 1) / 2 * 2048);  // [tile pairs][4][256]
    // prologue: output zeroed, x gathered per expert into B tiles
    for (int t; (t = next_row.fetch_add(1)) < T;) memset(out + (int64_t)t * H, 0, 4 * (size_t)H);
    for (int t; (t = next_tile.fetch_add(1)) < ntiles;) {
      const int e = ts.tile_expert[t], q0 = sc.expert_start[e] + (t - ts.tile_start[e]) * 16;
      build_xt<FMT>(x, H, sc.pair_tok.data() + q0, std::min(16, sc.expert_start[e + 1] - q0),
                    xt + (int64_t)t * G1 * TILE_ELEMS);
    }
    bar.wait(P->nthreads);
    if (caller) t_pro = now_s();
    // gate + up: this node's intermediate rows of every active expert
    int r0, r1;
    node_range(P, node, I, 32, r0, r1);
    const int nb = (r1 - r0 + RBT1 - 1) / RBT1;
    for (int64_t it; (it = s.next.fetch_add(1, std::memory_order_relaxed)) < (int64_t)A * nb;) {
      const int e = sc.active[it / nb];
      const int i0 = r0 + (int)(it % nb) * RBT1, i1 = std::min(r1, i0 + RBT1);
      const int tb = ts.tile_start[e], te = ts.tile_start[e + 1];
      const int m = sc.expert_start[e + 1] - sc.expert_start[e];
      for (int b = i0; b < i1; b += 16) {
        amx_rows<FMT>(L->gate[e], b, L->up[e], b, xt + (int64_t)tb * G1 * TILE_ELEMS, te - tb,
                      G1, abuf, c);
        for (int t = tb; t < te; ++t) {  // c: per tile pair gate, up (tile t), gate, up (t + 1)
          const float* ct = c + (int64_t)((t - tb) / 2) * 1024 + ((t - tb) & 1) * 512;
          write_h<FMT>(ct, ct + 256, b, std::min(16, m - (t - tb) * 16),
                       ht + (int64_t)t * G2 * TILE_ELEMS);
        }
      }
    }
    bar.wait(P->nthreads);
    if (caller) t_gu = now_s();
    if (rank == 0) s.next.store(0, std::memory_order_release);
    bar.wait(P->nthreads);
    // down: this node's output rows; each item owns its rows for every token
    int o0n, o1n;
    node_range(P, node, H, 32, o0n, o1n);
    const int per = K2_AMX_DOWN_SPLIT * P->node_size[node];
    const int RBT2 = std::max(1, ((o1n - o0n) / 32 + per - 1) / per) * 32;
    const int64_t items2 = (o1n - o0n + RBT2 - 1) / RBT2;
    for (int64_t it; (it = s.next.fetch_add(1, std::memory_order_relaxed)) < items2;) {
      const int o0 = o0n + (int)it * RBT2, o1 = std::min(o1n, o0 + RBT2);
      for (int e : sc.active) {
        const int tb = ts.tile_start[e], te = ts.tile_start[e + 1], p0 = sc.expert_start[e];
        const int m = sc.expert_start[e + 1] - p0;
        for (int b = o0; b < o1; b += 32) {
          amx_rows<FMT>(L->down[e], b, L->down[e], b + 16, ht + (int64_t)tb * G2 * TILE_ELEMS,
                        te - tb, G2, abuf, c);
          for (int t = tb; t < te; ++t) {  // c: rows b.., b + 16.. (tile t), the same (t + 1)
            const float* ct = c + (int64_t)((t - tb) / 2) * 1024 + ((t - tb) & 1) * 512;
            const int qb = (t - tb) * 16, valid = std::min(16, m - qb);
            __m512i r0[16], r1[16];  // C [row][pair] -> [pair][row]
            for (int n = 0; n < 16; ++n) {
              r0[n] = _mm512_load_si512(ct + n * 16);
              r1[n] = _mm512_load_si512(ct + 256 + n * 16);
            }
            transpose16(r0);
            transpose16(r1);
            for (int j = 0; j < valid; ++j) {
              const int q = p0 + qb + j;
              const __m512 w = _mm512_set1_ps(sc.pair_w[q]);
              float* o = out + (int64_t)sc.pair_tok[q] * H + b;
              const __m512 y0 = _mm512_castsi512_ps(r0[j]), y1 = _mm512_castsi512_ps(r1[j]);
              _mm512_storeu_ps(o, _mm512_fmadd_ps(w, y0, _mm512_loadu_ps(o)));
              _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(w, y1, _mm512_loadu_ps(o + 16)));
            }
          }
        }
      }
    }
    _tile_release();
  });
  const double t_end = now_s();
  g_profile.wake = t_in - t_run;
  g_profile.prologue = t_pro - t_in;
  g_profile.gate_up = t_gu - t_pro;
  g_profile.down = t_end - t_gu;
}
#endif  // K2_HAS_AMX
