// CUDA per-token log-prob / entropy from a chunk of LM-head logits and its backward (see csrc/cpu/logprob.cc).
#include "prl_cuda.cuh"

namespace {

__global__ void LogprobForwardKernel(const float* logits, const int64_t* labels, float* logp, float* entropy,
                                     float* lse, float* mean_z, int64_t v, float scale) {
  const float* x = logits + blockIdx.x * v;
  float local_max = -3.0e38f;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) local_max = fmaxf(local_max, x[i] * scale);
  const float m = prl_cuda::BlockMax(local_max, -3.0e38f);
  double s = 0.0, sz = 0.0;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
    const float z = x[i] * scale;
    const float e = expf(z - m);
    s += e;
    sz += static_cast<double>(e) * z;
  }
  s = prl_cuda::BlockSum(s);
  sz = prl_cuda::BlockSum(sz);
  if (threadIdx.x == 0) {
    const double l = m + log(s), mz = sz / s;
    int64_t y = labels[blockIdx.x];
    y = y < 0 ? 0 : (y >= v ? v - 1 : y);
    logp[blockIdx.x] = static_cast<float>(x[y] * scale - l);
    entropy[blockIdx.x] = static_cast<float>(l - mz);
    lse[blockIdx.x] = static_cast<float>(l);
    mean_z[blockIdx.x] = static_cast<float>(mz);
  }
}

__global__ void LogprobBackwardKernel(const float* logits, const int64_t* labels, const float* lse,
                                      const float* mean_z, const float* grad_logp, const float* grad_entropy,
                                      float* grad, int64_t v, float scale) {
  const int64_t r = blockIdx.x;
  const float* x = logits + r * v;
  float* g = grad + r * v;
  const float l = lse[r], mz = mean_z[r], a = grad_logp[r] * scale;
  const float c = (grad_entropy != nullptr ? grad_entropy[r] : 0.0f) * scale;
  const int64_t y = labels[r];
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
    const float z = x[i] * scale;
    const float p = expf(z - l);
    g[i] = -a * p - c * p * (z - mz) + (i == y ? a : 0.0f);
  }
}

}  // namespace

cudaError_t prl_cuda::LogprobForward(const float* logits, const int64_t* labels, float* logp, float* entropy,
                                     float* lse, float* mean_z, int64_t n, int64_t v, float scale,
                                     cudaStream_t stream) {
  if (n > 0) LogprobForwardKernel<<<n, kThreads, 0, stream>>>(logits, labels, logp, entropy, lse, mean_z, v, scale);
  return cudaGetLastError();
}

cudaError_t prl_cuda::LogprobBackward(const float* logits, const int64_t* labels, const float* lse,
                                      const float* mean_z, const float* grad_logp, const float* grad_entropy,
                                      float* grad, int64_t n, int64_t v, float scale, cudaStream_t stream) {
  if (n > 0)
    LogprobBackwardKernel<<<n, kThreads, 0, stream>>>(logits, labels, lse, mean_z, grad_logp, grad_entropy, grad, v,
                                                      scale);
  return cudaGetLastError();
}

#ifndef PRL_NO_PADDLE
std::vector<paddle::Tensor> LogprobForwardCUDA(const paddle::Tensor& logits, const paddle::Tensor& labels,
                                               float scale) {
  const int64_t n = logits.shape()[0], v = logits.shape()[1];
  std::vector<paddle::Tensor> outs;
  for (int k = 0; k < 4; ++k) outs.push_back(paddle::empty({n}, paddle::DataType::FLOAT32, logits.place()));
  prl_cuda::CheckLaunch(prl_cuda::LogprobForward(logits.data<float>(), labels.data<int64_t>(), outs[0].data<float>(),
                                                 outs[1].data<float>(), outs[2].data<float>(), outs[3].data<float>(),
                                                 n, v, scale, logits.stream()),
                        "prl_logprob");
  return outs;
}

std::vector<paddle::Tensor> LogprobBackwardCUDA(const paddle::Tensor& logits, const paddle::Tensor& labels,
                                                const paddle::Tensor& lse, const paddle::Tensor& mean_z,
                                                const paddle::Tensor& grad_logp,
                                                const paddle::optional<paddle::Tensor>& grad_entropy, float scale) {
  const int64_t n = logits.shape()[0], v = logits.shape()[1];
  auto grad = paddle::empty({n, v}, paddle::DataType::FLOAT32, logits.place());
  prl_cuda::CheckLaunch(
      prl_cuda::LogprobBackward(logits.data<float>(), labels.data<int64_t>(), lse.data<float>(), mean_z.data<float>(),
                                grad_logp.data<float>(), grad_entropy ? grad_entropy->data<float>() : nullptr,
                                grad.data<float>(), n, v, scale, logits.stream()),
      "prl_logprob_backward");
  return {grad};
}
#endif  // PRL_NO_PADDLE
