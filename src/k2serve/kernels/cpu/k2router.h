// k2serve CPU kernel, the noaux_tc router at decode (k2_router_topk, k2_router_select).
// Included at the end of k2cpu.cpp (one translation unit; the build key hashes this file).
//
// k2_router_topk = the gate's float32 logits GEMV on the pool (k2_linear_batched: the same sums
// as cpu_linear) + k2_router_select on the calling thread (384 scores: a few microseconds), in
// place of grouped_topk_torch's ~15 small torch ops per layer. The selection reproduces that
// function's results bit for bit, including the order of the ids, by doing what torch's CPU
// kernels do (the Python side passes the vector widths of the kernels torch dispatches to,
// checks the result against torch once, and falls back to torch elsewhere):
//   - scores = 1 / (1 + exp(0 - logit)): torch's vectorized sigmoid, whose exp is SLEEF's
//     expf_u10 (reproduced below: glibc's expf differs in ~4% of the floats by one ulp), over
//     the flattened [T, E] in chunks of two vectors (`sig_chunk` floats: 32 where torch runs
//     its AVX512 kernels); the tail past the last whole chunk takes torch's scalar loop
//     (std::exp: libm's expf), as does everything where torch's exp is libm's (sig_chunk 0);
//   - choice = scores + bias, NaN / -inf -> NAN_SCORE, +inf -> FLT_MAX (nan_to_num); a NaN
//     score weighs 0;
//   - the top-k (of the experts, of a group's 2, of the groups): torch's CPU topk below 64
//     elements per kept one: std::nth_element over (value, index) pairs in index order, with
//     `a > b` (libstdc++ here as in torch's build: the same permutation, hence the same
//     unsorted order of the ids and the same winner of a tie);
//   - the weights' sum: torch's inner sum over k contiguous floats, `sum_lanes` floats per
//     vector (8: torch's sum kernel is its AVX2 one on AVX512 CPUs too) (k below one vector:
//     four interleaved partial sums, row_sum; one to two vectors: a vector accumulator, then
//     the scalar tail first, vectorized_inner_sum), then w / (sum + 1e-20f) * scale.
// Shapes it does not cover (a top-k of >= 1/64 of its row: torch's heap path; k of two vectors
// or more) return 2 and the caller runs grouped_topk_torch.

#include <cfloat>

static const float K2_NAN_SCORE = -1.0e30f;  // kernels/router_torch.py NAN_SCORE

// SLEEF's expf_u10 (xexpf, the FMA build torch's Vectorized<float>::exp calls), one lane.
static inline float k2_sleef_expf(float d) {
  auto pow2i = [](int q) {
    uint32_t u = (uint32_t)(q + 0x7f) << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
  };
  // rint(d / ln 2); clamped first (the result is overridden out there: no float -> int overflow)
  const float qf = std::nearbyint(std::fmin(std::fmax(d * 1.442695040888963407f, -160.f), 160.f));
  const int q = (int)qf;
  float s = std::fma(qf, -0.693145751953125f, d);
  s = std::fma(qf, -1.428606765330187045e-06f, s);
  float u = 0.000198527617612853646278381f;
  u = std::fma(u, s, 0.00139304355252534151077271f);
  u = std::fma(u, s, 0.00833336077630519866943359f);
  u = std::fma(u, s, 0.0416664853692054748535156f);
  u = std::fma(u, s, 0.166666671633720397949219f);
  u = std::fma(u, s, 0.5f);
  const float ss = s * s;
  u = 1.0f + std::fma(ss, u, s);
  u = u * pow2i(q >> 1) * pow2i(q - (q >> 1));  // ldexp in two steps (SLEEF's vldexp2)
  if (d < -104.f) u = 0.f;
  if (d > 100.f) u = INFINITY;
  if (std::isnan(d)) u = NAN;
  return u;
}

// torch's CPU topk (k * 64 > n): ids[0..k) of the k largest vals, in nth_element's order.
static void k2_topk_ids(const float* vals, int n, int k, std::vector<std::pair<float, int64_t>>& q,
                        int64_t* ids, float* top = nullptr) {
  q.resize(n);
  for (int j = 0; j < n; ++j) q[j] = {vals[j], j};
  std::nth_element(q.begin(), q.begin() + (k - 1), q.end(),
                   [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
                     return a.first > b.first;
                   });
  for (int j = 0; j < k; ++j) {
    ids[j] = q[j].second;
    if (top) top[j] = q[j].first;
  }
}

// torch's float32 sum of k contiguous floats (SumKernel.cpp), `lanes` floats per vector.
static float k2_torch_row_sum(const float* x, int k, int lanes) {
  if (k < lanes) {  // scalar_inner_sum -> row_sum: 4 interleaved partial sums, then the tail
    float p[4] = {0.f, 0.f, 0.f, 0.f};
    const int n4 = k / 4;
    for (int i = 0; i < n4; ++i)
      for (int j = 0; j < 4; ++j) p[j] += x[4 * i + j];
    for (int i = n4 * 4; i < k; ++i) p[0] += x[i];
    return ((p[0] + p[1]) + p[2]) + p[3];
  }
  float acc = 0.f;  // vectorized_inner_sum, one vector (k < 2 lanes): the tail, then its lanes
  for (int i = lanes; i < k; ++i) acc += x[i];
  for (int i = 0; i < lanes; ++i) acc += 0.f + x[i];
  return acc;
}

extern "C" {

// The selection of grouped_topk_torch on float32 logits [T, E] (see the top of this file):
// ids [T, top_k] int64, weights [T, top_k] float32. bias: [E] float32 or null. sig_chunk,
// sum_lanes: torch's sigmoid chunk and sum vector (see the top of this file). Returns 0, 1 when
// a logit is NaN / inf (the ids and weights are written all the same), 2 when the shape is
// one torch handles otherwise (nothing written).
int k2_router_select(const float* logits, int T, int E, const float* bias, int top_k, int n_group,
                     int topk_group, int renorm, float scale, int sig_chunk, int sum_lanes,
                     int64_t* ids, float* weights) {
  if (T < 1 || E < 1 || n_group < 1 || E % n_group || top_k < 1 || top_k > E ||
      top_k * 64 <= E || sum_lanes < 2 || top_k >= 2 * sum_lanes || sig_chunk < 0)
    return 2;
  const int G = E / n_group;
  if (n_group > 1 && (G < 2 || 2 * 64 <= G || n_group > 1024 || topk_group < 1 ||
                      topk_group > n_group || topk_group * 64 <= n_group))
    return 2;
  static thread_local std::vector<float> score_tl, choice_tl;
  static thread_local std::vector<std::pair<float, int64_t>> q_tl;
  std::vector<float>&score = score_tl, &choice = choice_tl;
  score.resize(E);
  choice.resize(E);
  const int64_t n = (int64_t)T * E;
  const int64_t vec_end = sig_chunk ? n / sig_chunk * sig_chunk : 0;  // where the tail starts
  int rc = 0;
  for (int t = 0; t < T; ++t) {
    const float* lg = logits + (int64_t)t * E;
    for (int e = 0; e < E; ++e) {
      const float l = lg[e];
      if (!std::isfinite(l)) rc = 1;
      const float ex = (int64_t)t * E + e < vec_end ? k2_sleef_expf(0.f - l) : expf(-l);
      const float s = 1.f / (1.f + ex);
      float c = bias ? s + bias[e] : s;
      if (std::isnan(c) || c == -INFINITY) c = K2_NAN_SCORE;
      if (c == INFINITY) c = FLT_MAX;
      choice[e] = c;
      score[e] = std::isnan(s) ? 0.f : s;
    }
    if (n_group > 1) {  // groups ranked by the sum of their top-2 choices; the rest masked
      float gs[1024], top2[2];
      int64_t two[2], keep[1024];
      for (int g = 0; g < n_group; ++g) {
        k2_topk_ids(choice.data() + (int64_t)g * G, G, 2, q_tl, two, top2);
        gs[g] = k2_torch_row_sum(top2, 2, sum_lanes);
      }
      k2_topk_ids(gs, n_group, topk_group, q_tl, keep);
      bool on[1024] = {};
      for (int j = 0; j < topk_group; ++j) on[keep[j]] = true;
      for (int e = 0; e < E; ++e)
        if (!on[e / G]) choice[e] = -INFINITY;
    }
    int64_t* id = ids + (int64_t)t * top_k;
    float* w = weights + (int64_t)t * top_k;
    k2_topk_ids(choice.data(), E, top_k, q_tl, id);
    for (int j = 0; j < top_k; ++j) w[j] = score[id[j]];
    if (renorm) {
      const float den = k2_torch_row_sum(w, top_k, sum_lanes) + 1e-20f;
      for (int j = 0; j < top_k; ++j) w[j] = w[j] / den;
    }
    for (int j = 0; j < top_k; ++j) w[j] = w[j] * scale;
  }
  return rc;
}

// The router at decode in one call: logits [T, E] = x [T, K] @ W [E, K]^T in float32 on the
// pool (k2_linear_batched: W bf16 or float32, x bf16 or float32), then k2_router_select on
// the calling thread. logits: the caller's [T, E] float32 buffer, or null. Returns as
// k2_router_select (2 also when the GEMV does not take the shape).
int k2_router_topk(void* pool, int wfmt, const void* W, int E, int K, const void* x, int x_dtype,
                   int T, const float* bias, int top_k, int n_group, int topk_group, int renorm,
                   float scale, int sig_chunk, int sum_lanes, int64_t* ids, float* weights,
                   float* logits) {
  static thread_local std::vector<float> logits_tl;
  if (!logits) {
    logits_tl.resize((size_t)T * E);
    logits = logits_tl.data();
  }
  if (k2_linear_batched(pool, wfmt, W, 1, E, K, x, x_dtype, T, logits) != 0) return 2;
  return k2_router_select(logits, T, E, bias, top_k, n_group, topk_group, renorm, scale,
                          sig_chunk, sum_lanes, ids, weights);
}

}  // extern "C"
