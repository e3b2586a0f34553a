// Per-token log-prob of the label and entropy from a chunk of raw LM-head outputs, without a [N, V] log-softmax.
//   forward:  z = scale * logits; lse = logsumexp(z); logp = z[label] - lse; mean_z = sum softmax(z) * z;
//             entropy = lse - mean_z.
//   backward: d logits = scale * (g_logp * (onehot(label) - p) - g_entropy * p * (z - mean_z)), p = exp(z - lse).
// The LM-head matmuls around it run in Paddle (paddle_rl/ops/logprob.py), chunk by chunk.
#include <algorithm>
#include <limits>

#include "../prl_common.h"
#include "kernels.h"

void prl_cpu::LogprobForward(const float* xp, const int64_t* yp, float* lp, float* hp, float* sp, float* mp,
                             int64_t n, int64_t v, float scale) {
  prl::ParallelFor(n, v, [&](int, int64_t begin, int64_t end) {
    // locals, not the captured references: a store through a float pointer may alias a captured float (or the
    // loop bound), which keeps the loops below from vectorizing
    const int64_t vocab = v;
    const float sc = scale;
    std::vector<float> buffer(vocab);
    float* z = buffer.data();
    for (int64_t r = begin; r < end; ++r) {
      const float* x = xp + r * vocab;
      float m = -3.0e38f;
#pragma omp simd reduction(max : m)
      for (int64_t i = 0; i < vocab; ++i) {
        z[i] = x[i] * sc;
        m = std::max(m, z[i]);
      }
      // sums of e = exp(z - m) and e * z in double: 8 lanes at a time into 4-lane accumulators, then the rest
      prl::V4D s4 = {0, 0, 0, 0}, sz4 = s4;
      int64_t i = 0;
      for (; i + 8 <= vocab; i += 8) {
        const prl::V8 zi = prl::Load8(z + i);
        const prl::V8 e = prl::ExpF8(zi - m);
        const prl::V4D e0 = prl::LowD(e), e1 = prl::HighD(e);
        s4 += e0 + e1;
        sz4 += e0 * prl::LowD(zi) + e1 * prl::HighD(zi);
      }
      double s = prl::HSum4(s4), sz = prl::HSum4(sz4);
      for (; i < vocab; ++i) {
        const float e = prl::ExpF(z[i] - m);
        s += e;
        sz += static_cast<double>(e) * z[i];
      }
      const double l = m + std::log(s);
      const double mz = sz / s;
      lp[r] = static_cast<float>(z[yp[r]] - l);
      hp[r] = static_cast<float>(l - mz);
      sp[r] = static_cast<float>(l);
      mp[r] = static_cast<float>(mz);
    }
  });
}

void prl_cpu::LogprobBackward(const float* xp, const int64_t* yp, const float* sp, const float* mp, const float* gl,
                              const float* ge, float* gp, int64_t n, int64_t v, float scale) {
  prl::ParallelFor(n, v, [&](int, int64_t begin, int64_t end) {
    const int64_t vocab = v;  // locals: see LogprobForward
    const float sc = scale;
    for (int64_t r = begin; r < end; ++r) {
      const float* x = xp + r * vocab;
      float* g = gp + r * vocab;
      const float l = sp[r], mz = mp[r], a = gl[r] * sc, c = (ge ? ge[r] : 0.0f) * sc;
      int64_t i = 0;
      for (; i + 8 <= vocab; i += 8) {
        const prl::V8 z = prl::Load8(x + i) * sc;
        const prl::V8 p = prl::ExpF8(z - l);
        prl::Store8(g + i, -a * p - c * p * (z - mz));
      }
      for (; i < vocab; ++i) {
        const float z = x[i] * sc;
        const float p = prl::ExpF(z - l);
        g[i] = -a * p - c * p * (z - mz);
      }
      const int64_t y = yp[r];
      if (y >= 0 && y < vocab) g[y] += a;
    }
  });
}

namespace prl_cpu {
// (CPU only: no CUDA counterpart, so not in kernels.h, whose launchers the standalone CUDA check compares)
// argmax [n] int64 of each row of logits [n, v]: the first index of the row's largest value (paddle.argmax's tie
// rule; a NaN is skipped)
void RowArgmax(const float* logits, int64_t* argmax, int64_t n, int64_t v);
}  // namespace prl_cpu

void prl_cpu::RowArgmax(const float* xp, int64_t* ap, int64_t n, int64_t v) {
  prl::ParallelFor(n, v, [&](int, int64_t begin, int64_t end) {
    const int64_t vocab = v;  // a local: see LogprobForward
    for (int64_t r = begin; r < end; ++r) {
      const float* x = xp + r * vocab;
      float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
      for (int64_t i = 0; i < vocab; ++i) m = std::max(m, x[i]);
      int64_t at = 0;
      while (at < vocab && !(x[at] == m)) ++at;
      ap[r] = at < vocab ? at : 0;
    }
  });
}

#ifndef PRL_NO_PADDLE
#ifdef PRL_WITH_CUDA
std::vector<paddle::Tensor> LogprobForwardCUDA(const paddle::Tensor& logits, const paddle::Tensor& labels,
                                               float scale);
std::vector<paddle::Tensor> LogprobBackwardCUDA(const paddle::Tensor& logits, const paddle::Tensor& labels,
                                                const paddle::Tensor& lse, const paddle::Tensor& mean_z,
                                                const paddle::Tensor& grad_logp,
                                                const paddle::optional<paddle::Tensor>& grad_entropy, float scale);
#endif

namespace {

void CheckInputs(const paddle::Tensor& logits, const paddle::Tensor& labels, const char* op) {
  prl::CheckCpuFloat(logits, op, "logits");
  PD_CHECK(logits.shape().size() == 2, op, ": logits must be [N, V]");
  PD_CHECK(labels.dtype() == paddle::DataType::INT64 && labels.numel() == logits.shape()[0], op,
           ": labels must be int64 [N]");
}

}  // namespace

std::vector<paddle::Tensor> LogprobForward(const paddle::Tensor& logits, const paddle::Tensor& labels, float scale) {
#ifdef PRL_WITH_CUDA
  if (logits.is_gpu()) return LogprobForwardCUDA(logits, labels, scale);
#endif
  const char* op = "prl_logprob";
  CheckInputs(logits, labels, op);
  const int64_t n = logits.shape()[0], v = logits.shape()[1];
  auto logp = paddle::empty({n}, paddle::DataType::FLOAT32, logits.place());
  auto entropy = paddle::empty({n}, paddle::DataType::FLOAT32, logits.place());
  auto lse = paddle::empty({n}, paddle::DataType::FLOAT32, logits.place());
  auto mean_z = paddle::empty({n}, paddle::DataType::FLOAT32, logits.place());
  const int64_t* yp = labels.data<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    PD_CHECK(yp[r] >= 0 && yp[r] < v, op, ": a label is outside [0, ", v, ")");
  }
  prl_cpu::LogprobForward(logits.data<float>(), yp, logp.data<float>(), entropy.data<float>(), lse.data<float>(),
                          mean_z.data<float>(), n, v, scale);
  return {logp, entropy, lse, mean_z};
}

std::vector<paddle::Tensor> LogprobBackward(const paddle::Tensor& logits, const paddle::Tensor& labels,
                                            const paddle::Tensor& lse, const paddle::Tensor& mean_z,
                                            const paddle::Tensor& grad_logp,
                                            const paddle::optional<paddle::Tensor>& grad_entropy, float scale) {
#ifdef PRL_WITH_CUDA
  if (logits.is_gpu()) return LogprobBackwardCUDA(logits, labels, lse, mean_z, grad_logp, grad_entropy, scale);
#endif
  const char* op = "prl_logprob_backward";
  CheckInputs(logits, labels, op);
  const int64_t n = logits.shape()[0], v = logits.shape()[1];
  auto grad = paddle::empty({n, v}, paddle::DataType::FLOAT32, logits.place());
  prl_cpu::LogprobBackward(logits.data<float>(), labels.data<int64_t>(), lse.data<float>(), mean_z.data<float>(),
                           grad_logp.data<float>(), grad_entropy ? grad_entropy->data<float>() : nullptr,
                           grad.data<float>(), n, v, scale);
  return {grad};
}

// prl_logprob_backward's d logits written over the logits themselves (each element is read once, then written): no
// new [N, V] tensor per chunk of the LM head's backward
void LogprobBackwardInplace(paddle::Tensor& logits, const paddle::Tensor& labels, const paddle::Tensor& lse,
                            const paddle::Tensor& mean_z, const paddle::Tensor& grad_logp,
                            const paddle::optional<paddle::Tensor>& grad_entropy, float scale) {
  const char* op = "prl_logprob_backward_inplace";
  CheckInputs(logits, labels, op);
  const int64_t n = logits.shape()[0], v = logits.shape()[1];
  float* x = logits.data<float>();
  prl_cpu::LogprobBackward(x, labels.data<int64_t>(), lse.data<float>(), mean_z.data<float>(),
                           grad_logp.data<float>(), grad_entropy ? grad_entropy->data<float>() : nullptr, x, n, v,
                           scale);
}

std::vector<std::vector<int64_t>> LogprobInferShape(const std::vector<int64_t>& logits,
                                                    const std::vector<int64_t>& labels, float scale) {
  return {{logits[0]}, {logits[0]}, {logits[0]}, {logits[0]}};
}

std::vector<paddle::DataType> LogprobInferDtype(paddle::DataType logits, paddle::DataType labels) {
  return {logits, logits, logits, logits};
}

std::vector<std::vector<int64_t>> LogprobBackwardInferShape(
    const std::vector<int64_t>& logits, const std::vector<int64_t>& labels, const std::vector<int64_t>& lse,
    const std::vector<int64_t>& mean_z, const std::vector<int64_t>& grad_logp,
    const paddle::optional<std::vector<int64_t>>& grad_entropy, float scale) {
  return {logits};
}

std::vector<paddle::DataType> LogprobBackwardInferDtype(paddle::DataType logits, paddle::DataType labels,
                                                        paddle::DataType lse, paddle::DataType mean_z,
                                                        paddle::DataType grad_logp,
                                                        const paddle::optional<paddle::DataType>& grad_entropy) {
  return {logits};
}

// logits [N, V] float32 CPU -> the first index of each row's largest value, int64 [N]
std::vector<paddle::Tensor> RowArgmax(const paddle::Tensor& logits) {
  const char* op = "prl_row_argmax";
  prl::CheckCpuFloat(logits, op, "logits");
  PD_CHECK(logits.shape().size() == 2, op, ": logits must be [N, V]");
  const int64_t n = logits.shape()[0], v = logits.shape()[1];
  PD_CHECK(v > 0, op, ": logits have no columns");
  auto out = paddle::empty({n}, paddle::DataType::INT64, logits.place());
  prl_cpu::RowArgmax(logits.data<float>(), out.data<int64_t>(), n, v);
  return {out};
}

std::vector<std::vector<int64_t>> RowArgmaxInferShape(const std::vector<int64_t>& logits) { return {{logits[0]}}; }

std::vector<paddle::DataType> RowArgmaxInferDtype(paddle::DataType logits) { return {paddle::DataType::INT64}; }

PD_BUILD_OP(prl_row_argmax)
    .Inputs({"Logits"})
    .Outputs({"Argmax"})
    .SetKernelFn(PD_KERNEL(RowArgmax))
    .SetInferShapeFn(PD_INFER_SHAPE(RowArgmaxInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RowArgmaxInferDtype));

PD_BUILD_OP(prl_logprob)
    .Inputs({"Logits", "Labels"})
    .Outputs({"Logp", "Entropy", "Lse", "MeanZ"})
    .Attrs({"scale: float"})
    .SetKernelFn(PD_KERNEL(LogprobForward))
    .SetInferShapeFn(PD_INFER_SHAPE(LogprobInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(LogprobInferDtype));

PD_BUILD_OP(prl_logprob_backward_inplace)
    .Inputs({"Logits", "Labels", "Lse", "MeanZ", "GradLogp", paddle::Optional("GradEntropy")})
    .Outputs({"GradLogits"})
    .Attrs({"scale: float"})
    .SetInplaceMap({{"Logits", "GradLogits"}})
    .SetKernelFn(PD_KERNEL(LogprobBackwardInplace))
    .SetInferShapeFn(PD_INFER_SHAPE(LogprobBackwardInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(LogprobBackwardInferDtype));

PD_BUILD_OP(prl_logprob_backward)
    .Inputs({"Logits", "Labels", "Lse", "MeanZ", "GradLogp", paddle::Optional("GradEntropy")})
    .Outputs({"GradLogits"})
    .Attrs({"scale: float"})
    .SetKernelFn(PD_KERNEL(LogprobBackward))
    .SetInferShapeFn(PD_INFER_SHAPE(LogprobBackwardInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(LogprobBackwardInferDtype));
#endif  // PRL_NO_PADDLE
