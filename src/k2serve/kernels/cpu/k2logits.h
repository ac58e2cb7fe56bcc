// k2serve CPU kernel, a decode step's logits on the calling thread (k2_bf16_to_f32, k2_argmax).
// Included at the end of k2cpu.cpp (one translation unit; the build key hashes this file).
//
// At batch 1 the step's end was two torch ops above torch's OpenMP grain (32,768 elements):
// compute_logits' .to(float32) of the [1, 163,840] lm_head output and the sampler's greedy
// argmax. Torch's OpenMP team ran them and then spun on the cores the next step's first kernel
// calls need (benchmarks/cpu_sampler_probe.py). Here both run on the calling thread, no pool:
// a widening (exact) and torch's argmax rule (the first maximum; a NaN beats every number, the
// first NaN among NaNs), so the results are torch's.

// The first index of row r [V] holding a NaN (nan) or a value == m, or V.
static int64_t k2_first(const float* r, int64_t V, bool nan, float m) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(r + i);
    const __mmask16 k = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                            : _mm512_cmp_ps_mask(v, vm, _CMP_EQ_OQ);
    if (k) return i + __builtin_ctz((unsigned)k);
  }
#endif
  for (; i < V; ++i)
    if (nan ? std::isnan(r[i]) : r[i] == m) return i;
  return V;
}

extern "C" {

// dst[i] = src[i] widened from bf16 (exact), n elements.
void k2_bf16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}

// out[b] = torch.argmax(x[b]) for float32 rows x [B, V] (V >= 1): the max (and whether a NaN
// is there) in one pass, then the first index holding it (== : -0 and +0 are one value, as in
// torch's rule) or the first NaN.
void k2_argmax(const float* x, int B, int64_t V, int64_t* out) {
  for (int b = 0; b < B; ++b) {
    const float* r = x + (int64_t)b * V;
    float mx = -INFINITY;
    bool nan = false;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    __mmask16 vnan = 0;
    for (; i + 16 <= V; i += 16) {
      const __m512 v = _mm512_loadu_ps(r + i);
      vnan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vmx = _mm512_max_ps(vmx, v);
    }
    nan = vnan != 0;
    mx = _mm512_reduce_max_ps(vmx);
#endif
    for (; i < V; ++i) {
      nan = nan || std::isnan(r[i]);
      mx = r[i] > mx ? r[i] : mx;
    }
    out[b] = k2_first(r, V, nan, mx);
  }
}

}  // extern "C"
