// SwiGLU of a fused gate/up projection: x [..., 2F] = [gate | up] -> silu(gate) * up [..., F], with its backward.
#include "../prl_common.h"
#include "kernels.h"

namespace {

inline float Sigmoid(float a) { return 1.0f / (1.0f + prl::ExpF(-a)); }

// Sigmoid on 8 lanes (ExpF8: each lane equals Sigmoid of it bit for bit)
inline prl::V8 Sigmoid8(prl::V8 a) { return 1.0f / (1.0f + prl::ExpF8(-a)); }

}  // namespace

void prl_cpu::SwigluForward(const float* xp, float* op, int64_t n, int64_t f) {
  const int64_t width = 2 * f;
  prl::ParallelFor(n, width, [&](int, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = xp + r * width;
      const float* up = gate + f;
      float* o = op + r * f;
      int64_t i = 0;
      for (; i + 8 <= f; i += 8) {
        const prl::V8 a = prl::Load8(gate + i);
        prl::Store8(o + i, a * Sigmoid8(a) * prl::Load8(up + i));
      }
      for (; i < f; ++i) o[i] = gate[i] * Sigmoid(gate[i]) * up[i];
    }
  });
}

void prl_cpu::SwigluBackward(const float* xp, const float* gp, float* dp, int64_t n, int64_t f) {
  const int64_t width = 2 * f;
  prl::ParallelFor(n, width, [&](int, int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = xp + r * width;
      const float* up = gate + f;
      const float* g = gp + r * f;
      float* d_gate = dp + r * width;
      float* d_up = d_gate + f;
      int64_t i = 0;
      for (; i + 8 <= f; i += 8) {
        const prl::V8 a = prl::Load8(gate + i), u = prl::Load8(up + i), gi = prl::Load8(g + i);
        const prl::V8 s = Sigmoid8(a);
        prl::Store8(d_gate + i, gi * u * s * (1.0f + a * (1.0f - s)));
        prl::Store8(d_up + i, gi * a * s);
      }
      for (; i < f; ++i) {
        const float s = Sigmoid(gate[i]);
        d_gate[i] = g[i] * up[i] * s * (1.0f + gate[i] * (1.0f - s));
        d_up[i] = g[i] * gate[i] * s;
      }
    }
  });
}

#ifndef PRL_NO_PADDLE
#ifdef PRL_WITH_CUDA
std::vector<paddle::Tensor> SwigluForwardCUDA(const paddle::Tensor& x);
std::vector<paddle::Tensor> SwigluBackwardCUDA(const paddle::Tensor& x, const paddle::Tensor& grad_out);
#endif

std::vector<paddle::Tensor> SwigluForward(const paddle::Tensor& x) {
#ifdef PRL_WITH_CUDA
  if (x.is_gpu()) return SwigluForwardCUDA(x);
#endif
  prl::CheckCpuFloat(x, "prl_swiglu", "x");
  const int64_t width = prl::LastDim(x), f = width / 2, n = prl::Rows(x);
  PD_CHECK(width % 2 == 0, "prl_swiglu: the last axis must be even");
  auto shape = x.shape();
  shape.back() = f;
  auto out = paddle::empty(shape, x.dtype(), x.place());
  prl_cpu::SwigluForward(x.data<float>(), out.data<float>(), n, f);
  return {out};
}

std::vector<paddle::Tensor> SwigluBackward(const paddle::Tensor& x, const paddle::Tensor& grad_out) {
#ifdef PRL_WITH_CUDA
  if (x.is_gpu()) return SwigluBackwardCUDA(x, grad_out);
#endif
  const int64_t width = prl::LastDim(x), f = width / 2, n = prl::Rows(x);
  auto grad = paddle::empty(x.shape(), x.dtype(), x.place());
  prl_cpu::SwigluBackward(x.data<float>(), grad_out.data<float>(), grad.data<float>(), n, f);
  return {grad};
}

std::vector<std::vector<int64_t>> SwigluInferShape(const std::vector<int64_t>& x) {
  auto shape = x;
  shape.back() /= 2;
  return {shape};
}

std::vector<paddle::DataType> SwigluInferDtype(paddle::DataType x) { return {x}; }

PD_BUILD_OP(prl_swiglu)
    .Inputs({"X"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(SwigluForward))
    .SetInferShapeFn(PD_INFER_SHAPE(SwigluInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SwigluInferDtype));

PD_BUILD_GRAD_OP(prl_swiglu)
    .Inputs({"X", paddle::Grad("Out")})
    .Outputs({paddle::Grad("X")})
    .SetKernelFn(PD_KERNEL(SwigluBackward));
#endif  // PRL_NO_PADDLE
