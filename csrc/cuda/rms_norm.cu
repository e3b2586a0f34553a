// CUDA RMSNorm (see csrc/cpu/rms_norm.cc): one block per row.
#include "prl_cuda.cuh"

namespace {

__global__ void RmsNormForwardKernel(const float* x, const float* w, float* y, float* rstd, int64_t d, float eps) {
  const float* row = x + blockIdx.x * d;
  float* out = y + blockIdx.x * d;
  float ss = 0.0f;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) ss += row[j] * row[j];
  ss = prl_cuda::BlockSum(ss);
  const float r = rsqrtf(ss / d + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) out[j] = (row[j] * r) * w[j];
}

__global__ void RmsNormBackwardKernel(const float* x, const float* w, const float* rstd, const float* grad,
                                      float* gx, float* gw, int64_t d) {
  const float* row = x + blockIdx.x * d;
  const float* g = grad + blockIdx.x * d;
  float* out = gx + blockIdx.x * d;
  const float r = rstd[blockIdx.x];
  float dot = 0.0f;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) {
    const float xhat = row[j] * r;
    dot += g[j] * w[j] * xhat;
    atomicAdd(gw + j, g[j] * xhat);
  }
  const float mean = prl_cuda::BlockSum(dot) / d;
  for (int64_t j = threadIdx.x; j < d; j += blockDim.x) out[j] = r * (g[j] * w[j] - (row[j] * r) * mean);
}

}  // namespace

cudaError_t prl_cuda::RmsNormForward(const float* x, const float* w, float* y, float* rstd, int64_t n, int64_t d,
                                     float eps, cudaStream_t stream) {
  if (n > 0) RmsNormForwardKernel<<<n, kThreads, 0, stream>>>(x, w, y, rstd, d, eps);
  return cudaGetLastError();
}

cudaError_t prl_cuda::RmsNormBackward(const float* x, const float* w, const float* rstd, const float* grad, float* gx,
                                      float* gw, int64_t n, int64_t d, cudaStream_t stream) {
  const cudaError_t zeroed = cudaMemsetAsync(gw, 0, sizeof(float) * static_cast<size_t>(d), stream);
  if (zeroed != cudaSuccess) return zeroed;
  if (n > 0) RmsNormBackwardKernel<<<n, kThreads, 0, stream>>>(x, w, rstd, grad, gx, gw, d);
  return cudaGetLastError();
}

#ifndef PRL_NO_PADDLE
std::vector<paddle::Tensor> RmsNormForwardCUDA(const paddle::Tensor& x, const paddle::Tensor& w, float eps) {
  const int64_t d = x.shape().back(), n = x.numel() / d;
  auto out = paddle::empty(x.shape(), x.dtype(), x.place());
  auto rstd = paddle::empty({n}, paddle::DataType::FLOAT32, x.place());
  prl_cuda::CheckLaunch(prl_cuda::RmsNormForward(x.data<float>(), w.data<float>(), out.data<float>(),
                                                 rstd.data<float>(), n, d, eps, x.stream()),
                        "prl_rms_norm");
  return {out, rstd};
}

std::vector<paddle::Tensor> RmsNormBackwardCUDA(const paddle::Tensor& x, const paddle::Tensor& w,
                                                const paddle::Tensor& rstd, const paddle::Tensor& grad_out) {
  const int64_t d = x.shape().back(), n = x.numel() / d;
  auto gx = paddle::empty(x.shape(), x.dtype(), x.place());
  auto gw = paddle::empty(w.shape(), paddle::DataType::FLOAT32, w.place());  // zeroed by the launcher
  prl_cuda::CheckLaunch(prl_cuda::RmsNormBackward(x.data<float>(), w.data<float>(), rstd.data<float>(),
                                                  grad_out.data<float>(), gx.data<float>(), gw.data<float>(), n, d,
                                                  x.stream()),
                        "prl_rms_norm_grad");
  return {gx, gw};
}
#endif  // PRL_NO_PADDLE
