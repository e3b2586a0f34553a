// The rollout's low-precision packed weight formats (csrc/cpu/linear.cc describes each layout), named by the
// launchers of the CPU and CUDA kernels (no Paddle here: the standalone CUDA check includes it too).
#pragma once

#include <cstdint>

namespace prl {

constexpr int64_t kLowpPanel = 32;   // columns per panel
constexpr int64_t kLowpGroup = 128;  // weight_only_int4: rows of K per scale

// bfloat16: [P, ceil(K / 2), 64] bfloat16; int8: [P, K, 32] int8 with P * 32 scales; int4: [P, ceil(K / 2), 32]
// uint8 with [P, ceil(K / 128), 32] scales
enum class LowpFormat : int { kBF16 = 0, kInt8 = 1, kInt4 = 2 };

inline const char* LowpFormatName(LowpFormat f) {
  return f == LowpFormat::kBF16 ? "bfloat16" : f == LowpFormat::kInt8 ? "weight_only_int8" : "weight_only_int4";
}

inline int64_t LowpPanels(int64_t n) { return (n + kLowpPanel - 1) / kLowpPanel; }

// bytes of a packed weight W [K, n]
inline int64_t LowpPackedBytes(LowpFormat f, int64_t k_dim, int64_t n) {
  const int64_t panels = LowpPanels(n), k2 = (k_dim + 1) / 2;
  return f == LowpFormat::kBF16 ? panels * k2 * 2 * kLowpPanel * 2
                                : f == LowpFormat::kInt8 ? panels * k_dim * kLowpPanel : panels * k2 * kLowpPanel;
}

// float32 scales of a packed weight W [K, n] (bfloat16 has none: one 0 stands in)
inline int64_t LowpScaleCount(LowpFormat f, int64_t k_dim, int64_t n) {
  const int64_t panels = LowpPanels(n), groups = (k_dim + kLowpGroup - 1) / kLowpGroup;
  return f == LowpFormat::kBF16 ? 1 : f == LowpFormat::kInt8 ? panels * kLowpPanel : panels * groups * kLowpPanel;
}

}  // namespace prl
