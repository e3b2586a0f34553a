// CUDA sampling step (see csrc/cpu/sampling.cc for the definition): one block per row.
// top-k and top-p thresholds are found by bisection over an order-preserving integer key of the float64
// values (64 block-wide passes each), instead of a sort.
#include "prl_cuda.cuh"

namespace {

constexpr double kDropped = -1e9;

__device__ __forceinline__ uint64_t OrderKey(double v) {
  const uint64_t bits = static_cast<uint64_t>(__double_as_longlong(v));
  return (bits >> 63) ? ~bits : (bits | 0x8000000000000000ull);
}

__device__ __forceinline__ double KeyValue(uint64_t key) {
  const uint64_t bits = (key >> 63) ? (key & 0x7fffffffffffffffull) : ~key;
  return __longlong_as_double(static_cast<long long>(bits));
}

__device__ double RowMax(const double* z, int64_t v) {
  double m = -1.0e300;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) m = fmax(m, z[i]);
  return prl_cuda::BlockMax(m, -1.0e300);
}

__device__ double RowExp(const double* z, double* e, double m, int64_t v) {
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
    e[i] = exp(z[i] - m);
    s += e[i];
  }
  return prl_cuda::BlockSum(s);
}

__global__ void SampleKernel(const float* logits, const float* seen, const float* uniforms, const bool* ban,
                             const int64_t* stop, int64_t n_stop, double* zbuf, double* ebuf, int64_t* tokens,
                             float* logprob, int64_t v, float temperature, int top_k, float top_p, float penalty) {
  const int64_t r = blockIdx.x;
  const float* x = logits + r * v;
  double* z = zbuf + r * v;
  double* e = ebuf + r * v;
  const bool greedy = temperature <= 0.0f;
  const bool penalize = seen != nullptr && penalty != 1.0f;
  const bool banned = ban != nullptr && ban[r];
  const bool use_top_k = !greedy && top_k > 0 && top_k < v;
  const bool use_top_p = !greedy && top_p < 1.0f;
  const double inv_t = greedy ? 1.0 : 1.0 / static_cast<double>(temperature);
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) {
    float p = x[i];
    if (penalize && seen[r * v + i] > 0.0f) p = p > 0.0f ? p / penalty : p * penalty;
    if (banned)
      for (int64_t k = 0; k < n_stop; ++k)
        if (stop[k] == i) p = prl_cuda::kNegInf;
    z[i] = greedy ? static_cast<double>(p) : static_cast<double>(p) * inv_t;
  }
  __syncthreads();
  __shared__ int64_t token;
  __shared__ double shared_value;
  if (greedy) {
    // argmax, the first index on ties
    double best = -1.0e300;
    int64_t best_i = v;
    for (int64_t i = threadIdx.x; i < v; i += blockDim.x)
      if (z[i] > best) best = z[i], best_i = i;
    const double m = prl_cuda::BlockMax(best, -1.0e300);
    int64_t candidate = best == m ? best_i : v;
    // smallest index holding the maximum
    __shared__ unsigned long long first;
    if (threadIdx.x == 0) first = static_cast<unsigned long long>(v);
    __syncthreads();
    atomicMin(&first, static_cast<unsigned long long>(candidate));
    __syncthreads();
    if (threadIdx.x == 0) token = static_cast<int64_t>(first) < v ? static_cast<int64_t>(first) : 0;
    __syncthreads();
  } else {
    if (use_top_k) {
      // the k-th largest value: the largest key with at least k values at or above it
      uint64_t key = 0;
      for (int bit = 63; bit >= 0; --bit) {
        const uint64_t candidate = key | (1ull << bit);
        int count = 0;
        for (int64_t i = threadIdx.x; i < v; i += blockDim.x) count += OrderKey(z[i]) >= candidate;
        if (prl_cuda::BlockSum(count) >= top_k) key = candidate;
      }
      const double kth = KeyValue(key);
      for (int64_t i = threadIdx.x; i < v; i += blockDim.x)
        if (z[i] < kth) z[i] = kDropped;
      __syncthreads();
    }
    double m = RowMax(z, v);
    double total = RowExp(z, e, m, v);
    if (use_top_p) {
      // cut = the smallest value whose strictly-larger mass is below top_p: one key past the largest key whose
      // strictly-larger mass is still >= top_p
      const double p_keep = static_cast<double>(top_p);
      uint64_t key = 0;
      for (int bit = 63; bit >= 0; --bit) {
        const uint64_t candidate = key | (1ull << bit);
        double mass = 0.0;
        for (int64_t i = threadIdx.x; i < v; i += blockDim.x)
          if (OrderKey(z[i]) > candidate) mass += e[i];
        if (prl_cuda::BlockSum(mass) / total >= p_keep) key = candidate;
      }
      const double cut = KeyValue(key + 1);
      for (int64_t i = threadIdx.x; i < v; i += blockDim.x)
        if (z[i] < cut) z[i] = kDropped;
      __syncthreads();
      m = RowMax(z, v);
      total = RowExp(z, e, m, v);
    }
    // inverse CDF: each thread takes a contiguous segment; a block scan of the segment sums finds the crossing
    const int64_t seg = (v + blockDim.x - 1) / blockDim.x;
    const int64_t begin = threadIdx.x * seg, end = begin + seg < v ? begin + seg : v;
    double part = 0.0;
    for (int64_t i = begin; i < end; ++i) part += e[i] / total;
    __shared__ double prefix[1024];
    prefix[threadIdx.x] = part;
    __syncthreads();
    if (threadIdx.x == 0) {
      double acc = 0.0;
      for (int t = 0; t < static_cast<int>(blockDim.x); ++t) {
        const double s = prefix[t];
        prefix[t] = acc;
        acc += s;
      }
      shared_value = static_cast<double>(uniforms[r]) * acc;
      token = v - 1;
    }
    __syncthreads();
    const double threshold = shared_value;
    double cum = prefix[threadIdx.x];
    if (cum <= threshold && cum + part > threshold) {
      for (int64_t i = begin; i < end; ++i) {
        cum += e[i] / total;
        if (cum > threshold) {
          token = i;
          break;
        }
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) shared_value = m + log(total);
    __syncthreads();
  }
  // log softmax(logits / T) at the token
  double local = -1.0e300;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) local = fmax(local, static_cast<double>(x[i]) * inv_t);
  const double m2 = prl_cuda::BlockMax(local, -1.0e300);
  double s2 = 0.0;
  for (int64_t i = threadIdx.x; i < v; i += blockDim.x) s2 += exp(static_cast<double>(x[i]) * inv_t - m2);
  s2 = prl_cuda::BlockSum(s2);
  if (threadIdx.x == 0) {
    tokens[r] = token;
    logprob[r] = static_cast<float>(static_cast<double>(x[token]) * inv_t - (m2 + log(s2)));
  }
}

}  // namespace

cudaError_t prl_cuda::Sample(const float* logits, const float* seen, const float* uniforms, const bool* ban,
                             const int64_t* stop, int64_t n_stop, double* scratch, int64_t* tokens, float* logprob,
                             int64_t b, int64_t v, float temperature, int top_k, float top_p, float penalty,
                             cudaStream_t stream) {
  if (temperature > 0.0f && uniforms == nullptr) return cudaErrorInvalidValue;
  if (b > 0)
    SampleKernel<<<b, kThreads, 0, stream>>>(logits, seen, uniforms, ban, n_stop ? stop : nullptr, n_stop, scratch,
                                             scratch + b * v, tokens, logprob, v, temperature, top_k, top_p, penalty);
  return cudaGetLastError();
}

#ifndef PRL_NO_PADDLE
std::vector<paddle::Tensor> SampleCUDA(const paddle::Tensor& logits, const paddle::optional<paddle::Tensor>& seen,
                                       const paddle::optional<paddle::Tensor>& uniforms,
                                       const paddle::optional<paddle::Tensor>& ban, const paddle::Tensor& stop_ids,
                                       float temperature, int top_k, float top_p, float penalty) {
  const int64_t b = logits.shape()[0], v = logits.shape()[1];
  PD_CHECK(temperature <= 0.0f || uniforms, "prl_sample: sampling needs uniforms");
  auto tokens = paddle::empty({b}, paddle::DataType::INT64, logits.place());
  auto logprob = paddle::empty({b}, paddle::DataType::FLOAT32, logits.place());
  auto scratch = paddle::empty({static_cast<int64_t>(prl_cuda::SampleScratch(b, v))}, paddle::DataType::FLOAT64,
                               logits.place());
  prl_cuda::CheckLaunch(
      prl_cuda::Sample(logits.data<float>(), seen ? seen->data<float>() : nullptr,
                       uniforms ? uniforms->data<float>() : nullptr, ban ? ban->data<bool>() : nullptr,
                       stop_ids.numel() ? stop_ids.data<int64_t>() : nullptr, stop_ids.numel(), scratch.data<double>(),
                       tokens.data<int64_t>(), logprob.data<float>(), b, v, temperature, top_k, top_p, penalty,
                       logits.stream()),
      "prl_sample");
  return {tokens, logprob};
}
#endif  // PRL_NO_PADDLE
