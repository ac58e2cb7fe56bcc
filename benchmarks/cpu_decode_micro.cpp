// One thread's INT4 x bf16 decode loop (kernels/cpu/k2cpu.cpp, dot_block<FMT_I4BF>) over K2
// expert rows: in L2 (hot) and over many experts (cold), 1-8 tokens, in thread CPU time. The
// figures behind the decode-loop note in RESULTS.md (before/after: -DK2_I4BF_LEGACY=1).
//   g++ -O3 -march=native -std=gnu++17 -pthread benchmarks/cpu_decode_micro.cpp -o /tmp/dm
//   /tmp/dm EXPERTS ROWS TOKENS REPS [COLS]   e.g. /tmp/dm 16 2048 1 3 (cold), /tmp/dm 1 256 1 50
#include "../src/k2serve/kernels/cpu/k2cpu.cpp"
#include <stdio.h>
#include <time.h>
static double cpu_s() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char** argv) {
  int NE = argc > 1 ? atoi(argv[1]) : 1;  // experts
  int R = argc > 2 ? atoi(argv[2]) : 256, K = argc > 5 ? atoi(argv[5]) : 7168, G = K / 32;
  int nt = argc > 3 ? atoi(argv[3]) : 1;
  int reps = argc > 4 ? atoi(argv[4]) : 20;
  std::vector<std::vector<uint8_t>> w(NE); std::vector<std::vector<uint16_t>> s(NE); std::vector<Mat> m(NE);
  for (int e = 0; e < NE; ++e) {
    w[e].resize((size_t)R * K / 2); s[e].assign((size_t)R * G, 0x3c00);
    for (size_t i = 0; i < w[e].size(); ++i) w[e][i] = (i + e) * 2654435761u >> 24;
    mk_mat(m[e], FMT_INT4, (int64_t)w[e].data(), (int64_t)s[e].data(), K);
  }
  std::vector<uint16_t> x((size_t)8 * K, 0x3f80); std::vector<float> sums(8 * G, 32.f);
  const void* xs[8]; const float* ss[8];
  for (int t = 0; t < 8; ++t) { xs[t] = x.data() + t * K; ss[t] = sums.data() + t * G; }
  float y[32 * 8]; double acc = 0;
  double best = 1e9;
  for (int rep = 0; rep < reps; ++rep) {
    double t0 = cpu_s();
    for (int e = 0; e < NE; ++e)
      for (int r = 0; r < R; r += 32) { dot_block<FMT_I4BF>(m[e], r, 32, xs, ss, nt, y); acc += y[0]; }
    best = std::min(best, cpu_s() - t0);
  }
  double wts = (double)NE * R * K, bytes = wts / 2 * (1 + 1.0 / 8);
  printf("NE=%d R=%d nt=%d: %.3f ms  %.2f Gweights/s  %.2f GB/s (%g)\n", NE, R, nt, best * 1e3, wts / best / 1e9, bytes / best / 1e9, acc);
}
