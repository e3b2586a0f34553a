// softmax(scale * scores + bias) over the last axis, for the decoder's training and prefill attention.
//   scores [B, H, G * L, K] (H kv heads, G query heads per kv head folded into the rows), bias [B, 1, L, K]
//   additive (0 or -1e9), shared by every head: row r of scores reads bias row r % L.
//   backward: d scores = scale * p * (g - sum(g * p)); the bias (built from masks) gets no gradient.
// CPU only; the Python wrapper keeps other places on the pure-Paddle reference.
#include <algorithm>

#include "../prl_common.h"

namespace {

void CheckMaskedSoftmax(const paddle::Tensor& scores, const paddle::Tensor& bias, const char* op) {
  prl::CheckCpuFloat(scores, op, "scores");
  prl::CheckCpuFloat(bias, op, "bias");
  const auto& s = scores.shape();
  const auto& b = bias.shape();
  PD_CHECK(s.size() == 4 && b.size() == 4, op, ": scores [B, H, G*L, K] and bias [B, 1, L, K]");
  PD_CHECK((b[0] == s[0] || b[0] == 1) && b[1] == 1 && b[3] == s[3] && b[2] > 0 && s[2] % b[2] == 0, op,
           ": bias shape does not match scores");
}

}  // namespace

std::vector<paddle::Tensor> MaskedSoftmaxForward(const paddle::Tensor& scores, const paddle::Tensor& bias,
                                                 float scale) {
  const char* op = "prl_masked_softmax";
  CheckMaskedSoftmax(scores, bias, op);
  const auto& s = scores.shape();
  const int64_t batch = s[0], rows_per_batch = s[1] * s[2], k = s[3], l = bias.shape()[2];
  const int64_t bias_batch_stride = bias.shape()[0] == 1 ? 0 : l * k;
  auto out = paddle::empty(s, scores.dtype(), scores.place());
  const float* xp = scores.data<float>();
  const float* bp = bias.data<float>();
  float* yp = out.data<float>();
  prl::ParallelFor(batch * rows_per_batch, k, [&](int, int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t bi = row / rows_per_batch, q = (row % rows_per_batch) % l;
      const float* x = xp + row * k;
      const float* bias_row = bp + bi * bias_batch_stride + q * k;
      float* y = yp + row * k;
      float m = -3.0e38f;
#pragma omp simd reduction(max : m)
      for (int64_t i = 0; i < k; ++i) {
        y[i] = x[i] * scale + bias_row[i];
        m = std::max(m, y[i]);
      }
      const float inv = 1.0f / prl::ExpShiftSum(y, m, k);
#pragma omp simd
      for (int64_t i = 0; i < k; ++i) y[i] *= inv;
    }
  });
  return {out};
}

std::vector<paddle::Tensor> MaskedSoftmaxBackward(const paddle::Tensor& out, const paddle::Tensor& grad_out,
                                                  float scale) {
  const auto& s = out.shape();
  const int64_t rows = s[0] * s[1] * s[2], k = s[3];
  auto grad = paddle::empty(s, out.dtype(), out.place());
  const float* pp = out.data<float>();
  const float* gp = grad_out.data<float>();
  float* dp = grad.data<float>();
  prl::ParallelFor(rows, k, [&](int, int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* p = pp + row * k;
      const float* g = gp + row * k;
      float* d = dp + row * k;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < k; ++i) dot += g[i] * p[i];
#pragma omp simd
      for (int64_t i = 0; i < k; ++i) d[i] = scale * p[i] * (g[i] - dot);
    }
  });
  return {grad};
}

std::vector<std::vector<int64_t>> MaskedSoftmaxInferShape(const std::vector<int64_t>& scores,
                                                          const std::vector<int64_t>& bias, float scale) {
  return {scores};
}

std::vector<paddle::DataType> MaskedSoftmaxInferDtype(paddle::DataType scores, paddle::DataType bias) {
  return {scores};
}

PD_BUILD_OP(prl_masked_softmax)
    .Inputs({"Scores", "Bias"})
    .Outputs({"Out"})
    .Attrs({"scale: float"})
    .SetKernelFn(PD_KERNEL(MaskedSoftmaxForward))
    .SetInferShapeFn(PD_INFER_SHAPE(MaskedSoftmaxInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(MaskedSoftmaxInferDtype));

PD_BUILD_GRAD_OP(prl_masked_softmax)
    .Inputs({"Out", paddle::Grad("Out")})
    .Outputs({paddle::Grad("Scores")})
    .Attrs({"scale: float"})
    .SetKernelFn(PD_KERNEL(MaskedSoftmaxBackward));
