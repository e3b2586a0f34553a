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

cudaError_t prl_cuda::SwigluForward(const float* x, float* out, int64_t n, int64_t f, cudaStream_t stream) {
  const int64_t total = n * f;
  if (total > 0) SwigluForwardKernel<<<Blocks(total), kThreads, 0, stream>>>(x, out, total, f);
  return cudaGetLastError();
}

cudaError_t prl_cuda::SwigluBackward(const float* x, const float* grad_out, float* grad, int64_t n, int64_t f,
                                     cudaStream_t stream) {
  const int64_t total = n * f;
  if (total > 0) SwigluBackwardKernel<<<Blocks(total), kThreads, 0, stream>>>(x, grad_out, grad, total, f);
  return cudaGetLastError();
}

#ifndef PRL_NO_PADDLE
std::vector<paddle::Tensor> SwigluForwardCUDA(const paddle::Tensor& x) {
  const int64_t f = x.shape().back() / 2, n = f > 0 ? x.numel() / (2 * f) : 0;
  auto shape = x.shape();
  shape.back() = f;
  auto out = paddle::empty(shape, x.dtype(), x.place());
  prl_cuda::CheckLaunch(prl_cuda::SwigluForward(x.data<float>(), out.data<float>(), n, f, x.stream()), "prl_swiglu");
  return {out};
}

std::vector<paddle::Tensor> SwigluBackwardCUDA(const paddle::Tensor& x, const paddle::Tensor& grad_out) {
  const int64_t f = x.shape().back() / 2, n = f > 0 ? x.numel() / (2 * f) : 0;
  auto grad = paddle::empty(x.shape(), x.dtype(), x.place());
  prl_cuda::CheckLaunch(
      prl_cuda::SwigluBackward(x.data<float>(), grad_out.data<float>(), grad.data<float>(), n, f, x.stream()),
      "prl_swiglu_grad");
  return {grad};
}
#endif  // PRL_NO_PADDLE
