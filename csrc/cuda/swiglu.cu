// CUDA SwiGLU of a fused gate/up projection and its backward (see csrc/cpu/swiglu.cc).
#include "prl_cuda.cuh"

namespace {

__global__ void SwigluForwardKernel(const float* x, float* out, int64_t total, int64_t f) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= total) return;
  const int64_t r = idx / f, i = idx % f;
  const float gate = x[r * 2 * f + i], up = x[r * 2 * f + f + i];
  out[idx] = gate / (1.0f + expf(-gate)) * up;
}

__global__ void SwigluBackwardKernel(const float* x, const float* grad_out, float* grad, int64_t total, int64_t f) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= total) return;
  const int64_t r = idx / f, i = idx % f;
  const float gate = x[r * 2 * f + i], up = x[r * 2 * f + f + i], g = grad_out[idx];
  const float s = 1.0f / (1.0f + expf(-gate));
  grad[r * 2 * f + i] = g * up * s * (1.0f + gate * (1.0f - s));
  grad[r * 2 * f + f + i] = g * gate * s;
}

}  // namespace

std::vector<paddle::Tensor> SwigluForwardCUDA(const paddle::Tensor& x) {
  const int64_t f = x.shape().back() / 2, total = x.numel() / 2;
  auto shape = x.shape();
  shape.back() = f;
  auto out = paddle::empty(shape, x.dtype(), x.place());
  if (total > 0)
    SwigluForwardKernel<<<prl_cuda::Blocks(total), prl_cuda::kThreads, 0, x.stream()>>>(x.data<float>(),
                                                                                       out.data<float>(), total, f);
  prl_cuda::CheckLaunch("prl_swiglu");
  return {out};
}

std::vector<paddle::Tensor> SwigluBackwardCUDA(const paddle::Tensor& x, const paddle::Tensor& grad_out) {
  const int64_t f = x.shape().back() / 2, total = x.numel() / 2;
  auto grad = paddle::empty(x.shape(), x.dtype(), x.place());
  if (total > 0)
    SwigluBackwardKernel<<<prl_cuda::Blocks(total), prl_cuda::kThreads, 0, x.stream()>>>(
        x.data<float>(), grad_out.data<float>(), grad.data<float>(), total, f);
  prl_cuda::CheckLaunch("prl_swiglu_grad");
  return {grad};
}
