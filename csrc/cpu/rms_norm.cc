// Fused RMSNorm over the last axis: y = (x * rsqrt(mean(x^2) + eps)) * w, with its backward.
#include "../prl_common.h"
#include "kernels.h"

void prl_cpu::RmsNormForward(const float* xp, const float* wp, float* yp, float* rp, int64_t n, int64_t d,
                             float eps) {
  prl::ParallelFor(n, d, [&](int, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = xp + i * d;
      float* y = yp + i * d;
      // sum of squares in double, 8 lanes at a time into 4-lane accumulators, then the rest
      prl::V4D ss4 = {0, 0, 0, 0};
      int64_t j = 0;
      for (; j + 8 <= d; j += 8) {
        const prl::V8 x = prl::Load8(row + j);
        const prl::V4D x0 = prl::LowD(x), x1 = prl::HighD(x);
        ss4 += x0 * x0 + x1 * x1;
      }
      double ss = prl::HSum4(ss4);
      for (; j < d; ++j) ss += static_cast<double>(row[j]) * row[j];
      const float r = 1.0f / std::sqrt(static_cast<float>(ss / d) + eps);
      rp[i] = r;
      for (int64_t j = 0; j < d; ++j) y[j] = (row[j] * r) * wp[j];
    }
  });
}

// dx = r * (g*w - xhat * mean(g*w*xhat)), dw = sum over rows of g*xhat, xhat = x*r.
void prl_cpu::RmsNormBackward(const float* xp, const float* wp, const float* rp, const float* gp, float* gxp,
                              float* gwp, int64_t n, int64_t d) {
  // one dw accumulator per part (one allocation for all), summed in part order afterwards
  const int64_t parts = prl::ParallelParts(n, d);
  std::vector<double> acc(parts * d, 0.0);
  prl::ParallelFor(n, d, [&](int part, int64_t begin, int64_t end) {
    double* a = acc.data() + part * d;
    for (int64_t i = begin; i < end; ++i) {
      const float* row = xp + i * d;
      const float* g = gp + i * d;
      float* out = gxp + i * d;
      const float r = rp[i];
      // dot = sum of g*w*xhat and a += g*xhat in double, 8 lanes at a time (the compiler's own vectorization of
      // these mixed float / double loops gathers), then the rest
      prl::V4D dot4 = {0, 0, 0, 0};
      int64_t j = 0;
      for (; j + 8 <= d; j += 8) {
        const prl::V8 gv = prl::Load8(g + j), xhat = prl::Load8(row + j) * r, gw = gv * prl::Load8(wp + j);
        const prl::V4D x0 = prl::LowD(xhat), x1 = prl::HighD(xhat);
        dot4 += prl::LowD(gw) * x0 + prl::HighD(gw) * x1;
        prl::Store4(a + j, prl::Load4(a + j) + prl::LowD(gv) * x0);
        prl::Store4(a + j + 4, prl::Load4(a + j + 4) + prl::HighD(gv) * x1);
      }
      double dot = prl::HSum4(dot4);
      for (; j < d; ++j) {
        dot += static_cast<double>(g[j] * wp[j]) * (row[j] * r);
        a[j] += static_cast<double>(g[j]) * (row[j] * r);
      }
      const float mean = static_cast<float>(dot / d);
      j = 0;
      for (; j + 8 <= d; j += 8) {
        const prl::V8 gw = prl::Load8(g + j) * prl::Load8(wp + j);
        prl::Store8(out + j, r * (gw - (prl::Load8(row + j) * r) * mean));
      }
      for (; j < d; ++j) out[j] = r * (g[j] * wp[j] - (row[j] * r) * mean);
    }
  });
  for (int64_t j = 0; j < d; ++j) {
    double total = 0.0;
    for (int64_t p = 0; p < parts; ++p) total += acc[p * d + j];
    gwp[j] = static_cast<float>(total);
  }
}

#ifndef PRL_NO_PADDLE
#ifdef PRL_WITH_CUDA
std::vector<paddle::Tensor> RmsNormForwardCUDA(const paddle::Tensor& x, const paddle::Tensor& w, float eps);
std::vector<paddle::Tensor> RmsNormBackwardCUDA(const paddle::Tensor& x, const paddle::Tensor& w,
                                                const paddle::Tensor& rstd, const paddle::Tensor& grad_out);
#endif

std::vector<paddle::Tensor> RmsNormForward(const paddle::Tensor& x, const paddle::Tensor& w, float eps) {
#ifdef PRL_WITH_CUDA
  if (x.is_gpu()) return RmsNormForwardCUDA(x, w, eps);
#endif
  prl::CheckCpuFloat(x, "prl_rms_norm", "x");
  prl::CheckCpuFloat(w, "prl_rms_norm", "weight");
  const int64_t d = prl::LastDim(x), n = prl::Rows(x);
  PD_CHECK(w.numel() == d, "prl_rms_norm: weight has ", w.numel(), " elements, the last axis of x has ", d);
  auto out = paddle::empty(x.shape(), x.dtype(), x.place());
  auto rstd = paddle::empty({n}, paddle::DataType::FLOAT32, x.place());
  prl_cpu::RmsNormForward(x.data<float>(), w.data<float>(), out.data<float>(), rstd.data<float>(), n, d, eps);
  return {out, rstd};
}

std::vector<paddle::Tensor> RmsNormBackward(const paddle::Tensor& x, const paddle::Tensor& w,
                                            const paddle::Tensor& rstd, const paddle::Tensor& grad_out) {
#ifdef PRL_WITH_CUDA
  if (x.is_gpu()) return RmsNormBackwardCUDA(x, w, rstd, grad_out);
#endif
  const int64_t d = prl::LastDim(x), n = prl::Rows(x);
  auto gx = paddle::empty(x.shape(), x.dtype(), x.place());
  auto gw = paddle::empty(w.shape(), w.dtype(), w.place());
  prl_cpu::RmsNormBackward(x.data<float>(), w.data<float>(), rstd.data<float>(), grad_out.data<float>(),
                           gx.data<float>(), gw.data<float>(), n, d);
  return {gx, gw};
}

std::vector<std::vector<int64_t>> RmsNormInferShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w) {
  int64_t n = 1;
  for (size_t i = 0; i + 1 < x.size(); ++i) n *= x[i];
  return {x, {n}};
}

std::vector<paddle::DataType> RmsNormInferDtype(paddle::DataType x, paddle::DataType w) { return {x, x}; }

PD_BUILD_OP(prl_rms_norm)
    .Inputs({"X", "W"})
    .Outputs({"Out", "Rstd"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(RmsNormForward))
    .SetInferShapeFn(PD_INFER_SHAPE(RmsNormInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RmsNormInferDtype));

PD_BUILD_GRAD_OP(prl_rms_norm)
    .Inputs({"X", "W", "Rstd", paddle::Grad("Out")})
    .Outputs({paddle::Grad("X"), paddle::Grad("W")})
    .SetKernelFn(PD_KERNEL(RmsNormBackward));
#endif  // PRL_NO_PADDLE
