// y = x W for the rollout's few rows, W read from a packed copy (see paddle_rl/ops/linear.py).
//   x [..., K] float32; packed [P, K, 32] float32: column panel p holds W[:, 32 p : 32 p + 32], each k's 32
//   weights adjacent (the last panel zero-padded); n: W's columns (<= 32 P); out [..., n] float32.
// A panel is one contiguous stream, read from memory once per call and then from the L2 cache by each block of
// rows; each row's sums run over k in order, so a row's result does not depend on the other rows.
#include "../prl_common.h"

namespace {

constexpr int64_t kPanel = 32;  // columns per panel: four 8-float vectors
// rows per register tile: MR x 4 accumulators, 4 weight vectors and a broadcast (32 vector registers with
// AVX-512, else 16)
#ifdef __AVX512F__
constexpr int kRows = 6;
#else
constexpr int kRows = 3;
#endif

// out[m, 0 : cols] = sum_k x[m, k] panel[k, 0 : cols] for the MR rows of a tile
template <int MR>
inline void Tile(const float* x, int64_t k_dim, const float* panel, float* out, int64_t ldo, int64_t cols) {
  prl::V8 acc[MR][4] = {};
  for (int64_t k = 0; k < k_dim; ++k) {
    const float* w = panel + k * kPanel;
    const prl::V8 w0 = prl::Load8(w), w1 = prl::Load8(w + 8), w2 = prl::Load8(w + 16), w3 = prl::Load8(w + 24);
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * k_dim + k];
      acc[m][0] += xv * w0;
      acc[m][1] += xv * w1;
      acc[m][2] += xv * w2;
      acc[m][3] += xv * w3;
    }
  }
  for (int m = 0; m < MR; ++m) {
    if (cols == kPanel) {
      std::memcpy(out + m * ldo, acc[m], sizeof(acc[m]));
    } else {
      float tmp[kPanel];
      std::memcpy(tmp, acc[m], sizeof(tmp));
      std::memcpy(out + m * ldo, tmp, cols * sizeof(float));
    }
  }
}

// the last r < kRows rows of a panel in one tile of their size
template <int R>
inline void LastTile(int64_t r, const float* x, int64_t k_dim, const float* panel, float* out, int64_t ldo,
                     int64_t cols) {
  if constexpr (R >= 1) {
    if (r == R) return Tile<R>(x, k_dim, panel, out, ldo, cols);
    LastTile<R - 1>(r, x, k_dim, panel, out, ldo, cols);
  }
}

void Panels(const float* x, const float* packed, float* out, int64_t rows, int64_t k_dim, int64_t n, int64_t begin,
            int64_t end) {
  for (int64_t p = begin; p < end; ++p) {
    const float* panel = packed + p * k_dim * kPanel;
    const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
    int64_t m = 0;
    for (; m + kRows <= rows; m += kRows) Tile<kRows>(x + m * k_dim, k_dim, panel, out + m * n + col, n, cols);
    if (m < rows) LastTile<kRows - 1>(rows - m, x + m * k_dim, k_dim, panel, out + m * n + col, n, cols);
  }
}

}  // namespace

// W [K, N] (or [N, K] with transposed) -> [P, K, 32], P = ceil(N / 32), the last panel zero-padded
std::vector<paddle::Tensor> PackWeight(const paddle::Tensor& w, bool transposed) {
  const char* op = "prl_pack_weight";
  prl::CheckCpuFloat(w, op, "weight");
  PD_CHECK(w.shape().size() == 2, op, ": weight must be 2-D");
  const int64_t k_dim = w.shape()[transposed ? 1 : 0], n = w.shape()[transposed ? 0 : 1];
  const int64_t panels = (n + kPanel - 1) / kPanel;
  auto out = paddle::empty({panels, k_dim, kPanel}, w.dtype(), w.place());
  const float* src = w.data<float>();
  float* dst = out.data<float>();
  prl::ParallelFor(panels, k_dim * kPanel, [&](int, int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      float* panel = dst + p * k_dim * kPanel;
      const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
      if (cols < kPanel) std::fill(panel, panel + k_dim * kPanel, 0.0f);
      if (transposed) {  // panel[k, j] = w[col + j, k]: each source row is read in order
        for (int64_t j = 0; j < cols; ++j) {
          const float* row = src + (col + j) * k_dim;
          for (int64_t k = 0; k < k_dim; ++k) panel[k * kPanel + j] = row[k];
        }
      } else {  // panel[k, :] = w[k, col : col + 32]
        for (int64_t k = 0; k < k_dim; ++k) std::memcpy(panel + k * kPanel, src + k * n + col, cols * sizeof(float));
      }
    }
  });
  return {out};
}

std::vector<std::vector<int64_t>> PackWeightInferShape(const std::vector<int64_t>& w, bool transposed) {
  const int64_t k_dim = w[transposed ? 1 : 0], n = w[transposed ? 0 : 1];
  return {{(n + kPanel - 1) / kPanel, k_dim, kPanel}};
}

std::vector<paddle::DataType> PackWeightInferDtype(paddle::DataType w) { return {w}; }

PD_BUILD_OP(prl_pack_weight)
    .Inputs({"W"})
    .Outputs({"Out"})
    .Attrs({"transposed: bool"})
    .SetKernelFn(PD_KERNEL(PackWeight))
    .SetInferShapeFn(PD_INFER_SHAPE(PackWeightInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PackWeightInferDtype));

std::vector<paddle::Tensor> PackedLinear(const paddle::Tensor& x, const paddle::Tensor& packed, int64_t n) {
  const char* op = "prl_packed_linear";
  prl::CheckCpuFloat(x, op, "x");
  prl::CheckCpuFloat(packed, op, "packed");
  const auto& ps = packed.shape();
  const int64_t k_dim = prl::LastDim(x), rows = prl::Rows(x);
  PD_CHECK(ps.size() == 3 && ps[1] == k_dim && ps[2] == kPanel, op, ": packed must be [P, K, 32] with K = x's last ",
           "dim (", k_dim, ")");
  PD_CHECK(n >= 1 && n <= ps[0] * kPanel && n > (ps[0] - 1) * kPanel, op, ": n ", n, " does not match ", ps[0],
           " panels");
  std::vector<int64_t> shape = x.shape();
  shape.back() = n;
  auto out = paddle::empty(shape, x.dtype(), x.place());
  const float* xp = x.data<float>();
  float* o = out.data<float>();
  const float* pp = packed.data<float>();
  prl::ParallelFor(ps[0], rows * k_dim * kPanel, [&](int, int64_t begin, int64_t end) {
    Panels(xp, pp, o, rows, k_dim, n, begin, end);
  });
  return {out};
}

std::vector<std::vector<int64_t>> PackedLinearInferShape(const std::vector<int64_t>& x,
                                                         const std::vector<int64_t>& packed, int64_t n) {
  std::vector<int64_t> out = x;
  out.back() = n;
  return {out};
}

std::vector<paddle::DataType> PackedLinearInferDtype(paddle::DataType x, paddle::DataType packed) { return {x}; }

PD_BUILD_OP(prl_packed_linear)
    .Inputs({"X", "Packed"})
    .Outputs({"Out"})
    .Attrs({"n: int64_t"})
    .SetKernelFn(PD_KERNEL(PackedLinear))
    .SetInferShapeFn(PD_INFER_SHAPE(PackedLinearInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PackedLinearInferDtype));
