// k2serve CPU kernel, absorbed MLA decode over a paged bf16 latent cache (k2_mla_decode).
// Included by k2cpu.cpp after k2amx.h (one translation unit; the build key hashes this file).
//
// One call = the new tokens of one sequence (a decode, or a speculative verify step of a few
// tokens): rows = tokens x heads, q = [q_latent (L) | q_pe (R)] per row, bf16 (E = L + R), the
// cache rows [S, E] bf16 read in place through the block table (no gather), out [rows, L] bf16
// = softmax(scale * q . k) . k[:, :L], token t of n seeing keys 0 .. S - n + t (causal).
//
// Split-KV: the keys are cut into one contiguous range per pool thread (32-key aligned), each
// range in chunks of KC keys; per chunk, V packed once, then per group of 64 rows:
//   1. scores^T [keys, rows] float32 (lanes = rows);
//      AMX: C (16 keys x 16 rows) += A (16 cache rows x 32 dims, loaded straight from the page
//      with the row stride E) x B (Q^T in the tile unit's pair layout, packed once per call);
//      AVX512-BF16: per key, 16 rows += Q^T pair vectors (the same packing) x the key's dims
//      broadcast two at a time (vdpbf16ps);
//   2. softmax in float32 (log2 units) with a running max per row (online: the thread's
//      accumulator is rescaled when a row's max grows), p = 2^(s - m) rounded to bf16 into
//      P [rows, keys] (16 x 16 transposes);
//   3. acc [rows, L] += P x V, V = the chunk's latent columns with key pairs interleaved (the
//      B layout, 1 KB per 32 keys x 16 columns) (AMX: 2 x 2 tiles of C; AVX512: vdpbf16ps with
//      P's key pairs broadcast);
// then, after a barrier, each thread merges a share of the rows over the threads' (max, sum,
// acc) with float32 log-sum-exp weights and writes bf16. Scores, softmax and sums are float32;
// P and the output are rounded to bf16 (as a GPU flash kernel does).
//
// Paths: 1 = AMX (built with AMX and granted by Linux), 2 = AVX512-BF16; the caller asks for
// one (0: the best there is) and gets 0 back when it cannot run (then the torch paths run).
#include <climits>

#if K2_HAS_I4BF

#ifndef K2_MLA_KC
#define K2_MLA_KC 256  // keys per chunk (at 64 rows: scores 64 KB, V 256 KB, keys 288 KB: in L2)
#endif
static const int MLA_GROUP_BLOCKS = 4;  // row blocks (of 16 rows) per group

struct MlaCall {
  const uint16_t* kv;    // cache base, rows of E
  const int* pages;      // the sequence's pages
  uint16_t* out;         // [M, L]
  int M, Mp, J, D, E, L, ps, S, ctx, H, KC;
  float scale;
  const uint32_t* qt;    // [J][D][16 pairs][16 rows] dwords: Q^T in pair layout
  const uint16_t* zero;  // a zero cache row (keys past S)
  const uint16_t* key(int k) const {
    return k < S ? kv + ((int64_t)pages[k / ps] * ps + k % ps) * E : zero;
  }
};

struct MlaThread {  // one thread's buffers (thread_local, reused across calls)
  TileBuf s, p, v, acc, kbuf, ml;
  float *S, *acc_f, *m, *l;
  uint16_t *P, *V;
  void init(const MlaCall& c) {
    S = (float*)s.get((size_t)c.KC * MLA_GROUP_BLOCKS * 16 * 2);
    P = p.get((size_t)MLA_GROUP_BLOCKS * 16 * c.KC);
    V = v.get((size_t)c.KC * c.L);
    acc_f = (float*)acc.get((size_t)c.Mp * c.L * 2);
    float* f = (float*)ml.get((size_t)c.Mp * 4);
    m = f;
    l = f + c.Mp;
    for (int r = 0; r < c.Mp; ++r) m[r] = -1e30f, l[r] = 0.f;
    memset(acc_f, 0, (size_t)c.Mp * c.L * 4);
  }
};

// 2^t (t <= 0 here: softmax weights, rescale factors), degree-5 polynomial on the fraction
// (relative error ~3e-6: P is rounded to bf16 anyway); far below -126 it is 0.
static K2_INLINE __m512 exp2_512(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-150.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558146428443e-03f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Q^T in pair layout: dword (row r, dims 2p, 2p + 1) at qt[((j * D + p / 16) * 16 + p % 16) *
// 16 + r % 16] for r in row block j; rows past M are zero. Row r's dims are q_latent's row r
// (L, at ql + r * sl) then q_pe's (E - L, at qp + r * sp).
static void mla_pack_q(const uint16_t* ql, int64_t sl, const uint16_t* qp, int64_t sp, int M,
                       int J, int E, int L, uint32_t* qt) {
  const int D = E / 32;
  memset(qt, 0, (size_t)J * D * 256 * 4);
  for (int r = 0; r < M; ++r) {
    const uint32_t* a = (const uint32_t*)(ql + r * sl);
    const uint32_t* b = (const uint32_t*)(qp + r * sp) - L / 2;
    uint32_t* dst = qt + (int64_t)(r / 16) * D * 256 + (r % 16);
    for (int p = 0; p < E / 2; ++p) dst[p * 16] = p < L / 2 ? a[p] : b[p];  // p * 16: see above
  }
}

#if K2_HAS_AMX
// scores^T of 16 keys (A: rows at a, stride `astride` bytes) for NJ row blocks (<= 4) from qt:
// C tiles 0..NJ-1, stored to s (stride sstride bytes), row block jj at s + 16 jj.
// (Measured alternatives, 1 thread of the dev box, 8K keys: a software prefetch of the next
// block's rows, 2 key blocks x 2 row blocks of C: both within 3% of this.)
template <int NJ>
static void mla_scores_amx(const uint16_t* a, int astride, const uint32_t* qt, int D, float* s,
                           int sstride) {
  _tile_zero(0);
  if (NJ > 1) _tile_zero(1);
  if (NJ > 2) _tile_zero(2);
  if (NJ > 3) _tile_zero(3);
  const int64_t jstep = (int64_t)D * 256;
  for (int d = 0; d < D; ++d) {
    _tile_loadd(4, a + d * 32, astride);
    const uint32_t* b = qt + d * 256;
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (NJ > 1) {
      _tile_loadd(6, b + jstep, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (NJ > 2) {
      _tile_loadd(7, b + 2 * jstep, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (NJ > 3) {
      _tile_loadd(5, b + 3 * jstep, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, s, sstride);
  if (NJ > 1) _tile_stored(1, s + 16, sstride);
  if (NJ > 2) _tile_stored(2, s + 32, sstride);
  if (NJ > 3) _tile_stored(3, s + 48, sstride);
}

// acc rows [16 NJ] x columns [32] (2 col tiles) += P rows x V over nk32 keys.
template <int NJ>
static void mla_pv_amx(const uint16_t* p, int pstride, const uint16_t* v, int64_t vstep, int nkb,
                       float* acc, int astride) {
  _tile_loadd(0, acc, astride);
  _tile_loadd(1, acc + 16, astride);
  if (NJ > 1) {
    _tile_loadd(2, (const char*)acc + 16 * astride, astride);
    _tile_loadd(3, (const char*)acc + 16 * astride + 64, astride);
  }
  for (int kb = 0; kb < nkb; ++kb) {
    _tile_loadd(4, p + kb * 32, pstride);
    _tile_loadd(6, v + kb * vstep, 64);
    _tile_loadd(7, v + kb * vstep + TILE_ELEMS, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (NJ > 1) {
      _tile_loadd(5, (const char*)(p + kb * 32) + 16 * pstride, pstride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, astride);
  _tile_stored(1, acc + 16, astride);
  if (NJ > 1) {
    _tile_stored(2, (char*)acc + 16 * astride, astride);
    _tile_stored(3, (char*)acc + 16 * astride + 64, astride);
  }
}
#endif  // K2_HAS_AMX

// scores^T of up to 8 keys (pointers ks) for row block j, AVX512-BF16: lanes = rows; key i's
// 16 scores to s + i * sstride.
static void mla_scores_avx(const MlaCall& c, const uint16_t* const* ks, int nk, int j, float* s,
                           int sstride) {
  __m512 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
  const uint32_t* qt = c.qt + (int64_t)j * c.D * 256;
  for (int p = 0; p < c.E / 2; ++p) {
    const __m512bh qv = (__m512bh)_mm512_load_si512(qt + (p / 16) * 256 + (p % 16) * 16);
    for (int i = 0; i < 8; ++i)
      acc[i] = _mm512_dpbf16_ps(acc[i], qv,
                                (__m512bh)_mm512_set1_epi32(((const int*)ks[i])[p]));
  }
  for (int i = 0; i < nk; ++i) _mm512_storeu_ps(s + (int64_t)i * sstride, acc[i]);
}

// acc rows r0 .. r0 + nr - 1 (nr <= 4) x col tiles ct0 .. ct0 + 3 += P x V over npairs key
// pairs, AVX512-BF16 (P: those rows, stride KC).
static void mla_pv_avx(const MlaCall& c, const uint16_t* P, const uint16_t* V, int npairs, int r0,
                       int nr, int ct0, float* acc) {
  const int CT = c.L / 16;
  __m512 a[4][4];
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < 4; ++t)
      a[r][t] = r < nr ? _mm512_loadu_ps(acc + (int64_t)(r0 + r) * c.L + (ct0 + t) * 16)
                       : _mm512_setzero_ps();
  for (int p = 0; p < npairs; ++p) {
    const uint16_t* vb = V + ((int64_t)(p / 16) * CT * 16 + (p % 16)) * 32;  // [kb][ct][pp]
    __m512bh v[4];
    for (int t = 0; t < 4; ++t) v[t] = (__m512bh)_mm512_load_si512(vb + (ct0 + t) * TILE_ELEMS);
    for (int r = 0; r < nr; ++r) {
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(
          ((const int*)(P + (int64_t)r * c.KC))[p]);
      for (int t = 0; t < 4; ++t) a[r][t] = _mm512_dpbf16_ps(a[r][t], v[t], pr);
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int t = 0; t < 4; ++t)
      _mm512_storeu_ps(acc + (int64_t)(r0 + r) * c.L + (ct0 + t) * 16, a[r][t]);
}

// Keys k0 .. k1 - 1 (k0 a multiple of 32, k1 - k0 <= KC) into the thread's running state: V
// packed once, then per group of GROUP_BLOCKS row blocks (64 rows: one token's heads at K2's 64)
// the scores, softmax and P x V, so that the group's Q^T, scores and P stay in L2 whatever the
// number of rows (a verify step's 4-8 tokens).
template <bool AMX>
static void mla_chunk(const MlaCall& c, MlaThread& w, int k0, int k1) {
  const int nk = k1 - k0, nk32 = (nk + 31) & ~31, L = c.L, CT = L / 16;
  // V: key pairs interleaved, [kb32][col tile][16 pairs][16 cols][2]; keys past k1 zero
  alignas(64) int16_t ilo[32], ihi[32];
  for (int i = 0; i < 16; ++i) {
    ilo[2 * i] = i, ilo[2 * i + 1] = 32 + i;
    ihi[2 * i] = 16 + i, ihi[2 * i + 1] = 48 + i;
  }
  const __m512i lo = _mm512_load_si512(ilo), hi = _mm512_load_si512(ihi);
  for (int pr = 0; pr < nk32 / 2; ++pr) {
    const uint16_t* ka = c.key(2 * pr < nk ? k0 + 2 * pr : c.S);
    const uint16_t* kb = c.key(2 * pr + 1 < nk ? k0 + 2 * pr + 1 : c.S);
    uint16_t* dst = w.V + ((int64_t)(pr / 16) * CT * 16 + (pr % 16)) * 32;
    for (int x = 0; x < L; x += 32) {
      const __m512i a = _mm512_loadu_si512(ka + x), b = _mm512_loadu_si512(kb + x);
      _mm512_store_si512(dst + (x / 16) * TILE_ELEMS, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(dst + (x / 16 + 1) * TILE_ELEMS, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
  const __m512 c2 = _mm512_set1_ps(c.scale * 1.4426950408889634f);
  for (int jb = 0; jb < c.J; jb += MLA_GROUP_BLOCKS) {
    const int je = std::min(c.J, jb + MLA_GROUP_BLOCKS), Ms = (je - jb) * 16;
    // scores^T [nk32][Ms] (keys past k1 are computed on zero rows or left unset: masked below)
    if constexpr (AMX) {
#if K2_HAS_AMX
      for (int kb = 0; kb < nk; kb += 16) {
        const uint16_t* a;
        const int k = k0 + kb;
        if (c.ps % 16 == 0) {  // 16 keys in one page (rows past S are still inside it)
          a = c.key(k);
        } else {  // gather the 16 rows
          uint16_t* g = w.kbuf.get((size_t)16 * c.E);
          for (int i = 0; i < 16; ++i)
            memcpy(g + (int64_t)i * c.E, c.key(k + i), 2 * (size_t)c.E);
          a = g;
        }
        for (int j0 = jb; j0 < je; j0 += 4) {
          const uint32_t* qt = c.qt + (int64_t)j0 * c.D * 256;
          float* s = w.S + (int64_t)kb * Ms + (j0 - jb) * 16;
          switch (std::min(4, je - j0)) {
            case 1: mla_scores_amx<1>(a, 2 * c.E, qt, c.D, s, 4 * Ms); break;
            case 2: mla_scores_amx<2>(a, 2 * c.E, qt, c.D, s, 4 * Ms); break;
            case 3: mla_scores_amx<3>(a, 2 * c.E, qt, c.D, s, 4 * Ms); break;
            default: mla_scores_amx<4>(a, 2 * c.E, qt, c.D, s, 4 * Ms); break;
          }
        }
      }
#endif
    } else {
      for (int kb = 0; kb < nk; kb += 8) {
        const uint16_t* ks[8];
        for (int i = 0; i < 8; ++i) ks[i] = c.key(kb + i < nk ? k0 + kb + i : c.S);
        for (int j = jb; j < je; ++j)
          mla_scores_avx(c, ks, std::min(8, nk - kb), j,
                         w.S + (int64_t)kb * Ms + (j - jb) * 16, Ms);
      }
    }
    // softmax per row block, in log2 units (m = max of scale * log2(e) * s): running max,
    // rescale, P = 2^(s * c2 - m) [Ms][KC] bf16
    for (int j = jb; j < je; ++j) {
      alignas(64) int lim[16];
      int lmin = INT_MAX;  // keys up to lmin are visible to every real row of the block
      for (int i = 0; i < 16; ++i) {  // a row's last visible key (-1: a padding row)
        const int r = j * 16 + i;
        lim[i] = r < c.M ? c.ctx + r / c.H : -1;
        if (r < c.M) lmin = std::min(lmin, lim[i]);
      }
      const __m512i limv = _mm512_load_si512(lim);
      const __mmask16 real = _mm512_cmpge_epi32_mask(limv, _mm512_setzero_si512());
      auto visible = [&](int k) -> __mmask16 {  // rows of the block that see chunk key k
        if (k >= nk) return 0;
        return k0 + k <= lmin ? real : _mm512_cmple_epi32_mask(_mm512_set1_epi32(k0 + k), limv);
      };
      const float* S = w.S + (j - jb) * 16;
      __m512 mc = _mm512_set1_ps(-1e30f);
      for (int k = 0; k < nk; ++k)
        mc = _mm512_mask_max_ps(mc, visible(k), mc, _mm512_loadu_ps(S + (int64_t)k * Ms));
      const __m512 mold = _mm512_loadu_ps(w.m + j * 16);
      const __m512 mnew = _mm512_max_ps(mold, _mm512_mul_ps(mc, c2));
      const __mmask16 grew = _mm512_cmp_ps_mask(mnew, mold, _CMP_GT_OQ);
      if (grew) {  // rows whose max grew: their sum and accumulator shrink by 2^(old - new)
        alignas(64) float alpha[16];
        _mm512_store_ps(alpha, exp2_512(_mm512_sub_ps(mold, mnew)));
        _mm512_storeu_ps(w.l + j * 16, _mm512_mul_ps(_mm512_loadu_ps(w.l + j * 16),
                                                     _mm512_load_ps(alpha)));
        for (int i = 0; i < 16; ++i) {
          if (!((grew >> i) & 1) || w.l[j * 16 + i] == 0.f) continue;
          float* a = w.acc_f + (int64_t)(j * 16 + i) * L;
          const __m512 al = _mm512_set1_ps(alpha[i]);
          for (int x = 0; x < L; x += 16)
            _mm512_storeu_ps(a + x, _mm512_mul_ps(_mm512_loadu_ps(a + x), al));
        }
        _mm512_storeu_ps(w.m + j * 16, mnew);
      }
      __m512 lsum = _mm512_setzero_ps();
      for (int kb = 0; kb < nk32; kb += 32) {
        __m512i r[2][16];
        for (int h = 0; h < 2; ++h)
          for (int i = 0; i < 16; ++i) {
            const int k = kb + 16 * h + i;
            const __mmask16 ok = visible(k);
            __m512 e = _mm512_setzero_ps();
            if (ok) {
              const __m512 t = _mm512_fmsub_ps(_mm512_loadu_ps(S + (int64_t)k * Ms), c2, mnew);
              e = _mm512_maskz_mov_ps(ok, exp2_512(t));
              lsum = _mm512_add_ps(lsum, e);
            }
            r[h][i] = _mm512_castps_si512(e);
          }
        transpose16(r[0]);
        transpose16(r[1]);
        for (int i = 0; i < 16; ++i)
          _mm512_storeu_si512(w.P + (int64_t)((j - jb) * 16 + i) * c.KC + kb,
                              (__m512i)_mm512_cvtne2ps_pbh(_mm512_castsi512_ps(r[1][i]),
                                                            _mm512_castsi512_ps(r[0][i])));
      }
      _mm512_storeu_ps(w.l + j * 16, _mm512_add_ps(_mm512_loadu_ps(w.l + j * 16), lsum));
    }
    // acc += P x V
    if constexpr (AMX) {
#if K2_HAS_AMX
      for (int j0 = jb; j0 < je; j0 += 2)
        for (int ct = 0; ct < CT; ct += 2) {
          float* a = w.acc_f + (int64_t)j0 * 16 * L + ct * 16;
          const uint16_t* v = w.V + (int64_t)ct * TILE_ELEMS;
          const uint16_t* pj = w.P + (int64_t)(j0 - jb) * 16 * c.KC;
          const int64_t vstep = (int64_t)CT * TILE_ELEMS;
          if (je - j0 >= 2)
            mla_pv_amx<2>(pj, 2 * c.KC, v, vstep, nk32 / 32, a, 4 * L);
          else
            mla_pv_amx<1>(pj, 2 * c.KC, v, vstep, nk32 / 32, a, 4 * L);
        }
#endif
    } else {
      for (int r0 = jb * 16; r0 < std::min(c.M, je * 16); r0 += 4)
        for (int ct = 0; ct < CT; ct += 4)
          mla_pv_avx(c, w.P + (int64_t)(r0 - jb * 16) * c.KC, w.V, nk32 / 2, r0,
                     std::min(4, c.M - r0), ct, w.acc_f);
    }
  }
}

// q_latent rows [n * H] of L at ql (row stride sl elements), q_pe rows of E - L at qp (stride sp);
// the cache [num_pages][page_size][E] at kv; out [n * H, L] bf16. Returns the path that ran, 0
// when none can run here, -1 for bad arguments (a page id outside the cache included).
extern "C" int k2_mla_decode(void* pool, const void* ql, int64_t sl, const void* qp, int64_t sp,
                             int n, int H, const void* kv, int num_pages, int page_size, int E,
                             int L, const int* pages, int S, float scale, void* out, int path) {
  if (n < 1 || H < 1 || E % 32 || L % 32 || L >= E || S < n || page_size < 1) return -1;
  for (int i = 0; i < (S + page_size - 1) / page_size; ++i)
    if (pages[i] < 0 || pages[i] >= num_pages) return -1;
  const bool amx = K2_HAS_AMX && amx_permitted();
  if (path == 0) path = amx ? 1 : 2;
  if ((path == 1 && !amx) || (path != 1 && path != 2)) return 0;
  Pool* P = (Pool*)pool;
  std::lock_guard<std::mutex> call(P->call_mu);
  MlaCall c;
  c.kv = (const uint16_t*)kv, c.pages = pages;
  c.out = (uint16_t*)out;
  c.M = n * H, c.Mp = (c.M + 15) & ~15, c.J = c.Mp / 16, c.D = E / 32, c.E = E, c.L = L;
  c.ps = page_size, c.S = S, c.ctx = S - n, c.H = H, c.scale = scale;
  c.KC = K2_MLA_KC;
  static_assert(K2_MLA_KC % 32 == 0, "K2_MLA_KC: a multiple of 32 keys");
  static thread_local TileBuf qt_tl, zero_tl;
  uint32_t* qt = (uint32_t*)qt_tl.get((size_t)c.J * c.D * 512);
  mla_pack_q((const uint16_t*)ql, sl, (const uint16_t*)qp, sp, c.M, c.J, E, L, qt);
  c.qt = qt;
  uint16_t* zero = zero_tl.get((size_t)E + 32);
  memset(zero, 0, 2 * ((size_t)E + 32));
  c.zero = zero;
  const int T = P->nthreads, nb = (S + 31) / 32;
  std::vector<MlaThread*> ws(T);
  std::atomic<int> slot{0};
  AllBarrier bar;
  P->run([&](int, int) {
    static thread_local MlaThread w_tl;
    MlaThread& w = w_tl;
    const int me = slot.fetch_add(1);
    ws[me] = &w;
    w.init(c);
    const int k0 = (int)((int64_t)nb * me / T) * 32;
    const int k1 = std::min(S, (int)((int64_t)nb * (me + 1) / T) * 32);
#if K2_HAS_AMX
    if (path == 1) {
      tile_config();
      for (int k = k0; k < k1; k += c.KC) mla_chunk<true>(c, w, k, std::min(k1, k + c.KC));
      _tile_release();
    } else
#endif
      for (int k = k0; k < k1; k += c.KC) mla_chunk<false>(c, w, k, std::min(k1, k + c.KC));
    bar.wait(T);
    // merge a share of the rows over the threads
    const int r0 = (int64_t)c.M * me / T, r1 = (int64_t)c.M * (me + 1) / T;
    static thread_local std::vector<float> wt_tl;
    std::vector<float>& wt = wt_tl;
    wt.resize(T);
    for (int r = r0; r < r1; ++r) {
      float mx = -1e30f;
      for (int t = 0; t < T; ++t) mx = std::max(mx, ws[t]->m[r]);
      float den = 0.f;
      for (int t = 0; t < T; ++t) {
        wt[t] = ws[t]->l[r] > 0.f ? std::exp2(ws[t]->m[r] - mx) : 0.f;
        den += wt[t] * ws[t]->l[r];
      }
      for (int t = 0; t < T; ++t) wt[t] /= den;
      uint16_t* o = c.out + (int64_t)r * L;
      for (int x = 0; x < L; x += 16) {
        __m512 y = _mm512_setzero_ps();
        for (int t = 0; t < T; ++t)
          if (wt[t] != 0.f)
            y = _mm512_fmadd_ps(_mm512_set1_ps(wt[t]),
                                _mm512_loadu_ps(ws[t]->acc_f + (int64_t)r * L + x), y);
        _mm256_storeu_si256((__m256i*)(o + x), (__m256i)_mm512_cvtneps_pbh(y));
      }
    }
  });
  return path;
}

#else  // no AVX512-BF16: the torch paths run

extern "C" int k2_mla_decode(void*, const void*, int64_t, const void*, int64_t, int, int,
                             const void*, int, int, int, int, const int*, int, float, void*, int) {
  return 0;
}

#endif  // K2_HAS_I4BF
