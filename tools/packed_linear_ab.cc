// The rollout's packed float32 product (csrc/cpu/linear.cc, Panels) timed alone on one thread, at the decode's
// shapes of the quickstart, W1, W3 and W5, so two versions of the kernel can be compared in alternating processes:
//
//   for v in old new; do git show ${REV_OF_v}:csrc/cpu/linear.cc | sed -e 's#"[.][.]/prl_#"prl_#' \
//       -e 's#"kernels.h"#"cpu/kernels.h"#' > /tmp/linear_$v.cc; done   # each version, its includes from csrc/
//   for v in old new; do g++ -O3 -march=native -fopenmp-simd -fno-math-errno -DPRL_NO_PADDLE -Icsrc \
//       -DSRC="\"/tmp/linear_$v.cc\"" tools/packed_linear_ab.cc csrc/cpu/bf16_matmul.cc -o /tmp/$v -pthread; done
//   for r in 1 2 3 4 5; do /tmp/old; /tmp/new; done        # the best of each shape is the figure
//
// Prints per shape (rows x K x N): GFLOP/s (the best of 7 rounds) and a checksum of the output (equal checksums:
// the same sums).
#include SRC
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  const int64_t shapes[][3] = {{64, 256, 512},   {64, 256, 256},  {64, 256, 1376}, {64, 688, 256},
                               {64, 256, 4096},  {256, 128, 256}, {256, 128, 688}, {256, 344, 128},
                               {256, 128, 300},  {64, 576, 960},  {64, 1536, 576}, {16, 896, 1152},
                               {16, 4864, 896},  {1, 576, 1536},  {3, 128, 300},   {8, 576, 49152}};
  std::mt19937 gen(0);
  std::normal_distribution<float> normal;
  for (const auto& s : shapes) {
    const int64_t m = s[0], k = s[1], n = s[2], panels = (n + 31) / 32;
    std::vector<float> x(m * k), w(k * n), packed(panels * k * 32), out(m * n);
    for (auto& v : x) v = normal(gen);
    for (auto& v : w) v = normal(gen);
    for (int64_t p = 0; p < panels; ++p) PanelOf(w.data(), k, n, false, p, packed.data() + p * k * 32);
    const int64_t calls = std::max<int64_t>(3, static_cast<int64_t>(3e8 / (2.0 * m * k * n)));
    double best = 1e9;
    for (int round = 0; round < 7; ++round) {
      const auto start = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < calls; ++i) Panels(x.data(), packed.data(), out.data(), m, k, n, 0, panels);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / calls);
    }
    double checksum = 0;
    for (float v : out) checksum += v;
    std::printf("%ldx%ldx%ld %.1f GFLOP/s checksum %.6f\n", static_cast<long>(m), static_cast<long>(k),
                static_cast<long>(n), 2.0 * m * k * n / best / 1e9, checksum);
  }
}
