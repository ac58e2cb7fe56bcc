// One thread's rates for the AMX prompt path's two parts (kernels/cpu/k2amx.h): INT4
// dequantization to bf16 tiles, and the tile products, over 40 K2 experts' gate/up rows (587 MB,
// beyond the caches), in thread CPU time. The figures the per-core note in RESULTS.md cites.
//   g++ -O3 -march=native -std=gnu++17 -pthread benchmarks/cpu_amx_micro.cpp -o /tmp/amx_micro
//   /tmp/amx_micro          (needs a CPU with AMX-BF16)
#include "../src/k2serve/kernels/cpu/k2cpu.cpp"

#include <stdio.h>
#include <time.h>

#if K2_HAS_AMX
static double cpu_s() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main() {
  if (!amx_permitted()) return printf("AMX not granted\n"), 1;
  const int NE = 40, R = 4096, K = 7168, G = K / 32, TILES = 3;  // 43 pairs -> 3 tiles
  std::vector<std::vector<uint8_t>> w(NE);
  std::vector<std::vector<uint16_t>> s(NE);
  std::vector<Mat> m(NE);
  for (int e = 0; e < NE; ++e) {
    w[e].resize((size_t)R * K / 2);
    s[e].assign((size_t)R * G, 0x3c00);
    for (size_t i = 0; i < w[e].size(); ++i) w[e][i] = (i + e) * 2654435761u >> 24;
    mk_mat(m[e], FMT_INT4, (int64_t)w[e].data(), (int64_t)s[e].data(), K);
  }
  TileBuf ab, bb, cb;
  uint16_t* abuf = ab.get((size_t)G * 2 * TILE_ELEMS);
  uint16_t* b = bb.get((size_t)TILES * G * TILE_ELEMS);
  for (size_t i = 0; i < (size_t)TILES * G * TILE_ELEMS; ++i) b[i] = 0x3f80;
  float* c = (float*)cb.get(4096);
  tile_config();
  const double weights = (double)NE * R * K, flops = weights * TILES * 16 * 2;
  const char* names[3] = {"dequantize", "dequantize + tiles", "tiles"};
  for (int mode = 0; mode < 3; ++mode) {
    const double t0 = cpu_s();
    for (int e = 0; e < NE; ++e)
      for (int r = 0; r < R / 2; r += 16) {
        if (mode == 0) {
          for (int n = 0; n < 16; ++n) {
            deq_row_bf16<FMT_INT4>(m[e], r + n, 0, G, abuf + n * 32, 2 * TILE_ELEMS);
            deq_row_bf16<FMT_INT4>(m[e], R / 2 + r + n, 0, G, abuf + TILE_ELEMS + n * 32,
                                   2 * TILE_ELEMS);
          }
        } else if (mode == 1) {
          amx_rows<FMT_INT4>(m[e], r, m[e], R / 2 + r, b, TILES, G, abuf, c);
        } else {
          amx_acc(abuf, b, b + G * TILE_ELEMS, G, c, true);
          amx_acc(abuf, b + 2 * G * TILE_ELEMS, nullptr, G, c + 1024, true);
        }
      }
    const double dt = cpu_s() - t0;
    printf("%-20s %7.1f ms  %6.2f Gweights/s  %5.2f TFLOP/s\n", names[mode], dt * 1e3,
           weights / dt / 1e9, flops / dt / 1e12);
  }
  _tile_release();
  return 0;
}
#else
int main() { return printf("built without AMX (needs -march=native on an AMX CPU)\n"), 1; }
#endif
