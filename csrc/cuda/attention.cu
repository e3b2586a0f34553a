// CUDA decode attention over the KV cache (see csrc/cpu/attention.cc): one block per (row, query head); the cache
// is float32, bfloat16 or float16 (read as float32).
#include "prl_cuda.cuh"

namespace {

template <typename T>
__global__ void DecodeAttentionKernel(const float* q, const T* cache_k, const T* cache_v, const int64_t* start,
                                      float* scores, float* out, int64_t heads, int64_t kv, int64_t cap, int64_t d,
                                      int64_t length, float scale) {
  const int64_t bi = blockIdx.x, h = blockIdx.y, g = h / (heads / kv);
  int64_t first = start[bi];
  first = first < 0 ? 0 : (first > length - 1 ? length - 1 : first);
  const float* qh = q + (bi * heads + h) * d;
  const T* keys = cache_k + (bi * kv + g) * cap * d;
  const T* values = cache_v + (bi * kv + g) * cap * d;
  float* sc = scores + (bi * heads + h) * cap;
  float local_max = -3.0e38f;
  for (int64_t s = first + threadIdx.x; s < length; s += blockDim.x) {
    float dot = 0.0f;
    for (int64_t i = 0; i < d; ++i) dot += qh[i] * prl_cuda::ToFloat(keys[s * d + i]);
    sc[s] = dot * scale;
    local_max = fmaxf(local_max, sc[s]);
  }
  const float m = prl_cuda::BlockMax(local_max, -3.0e38f);
  float local_sum = 0.0f;
  for (int64_t s = first + threadIdx.x; s < length; s += blockDim.x) {
    sc[s] = expf(sc[s] - m);
    local_sum += sc[s];
  }
  const float total = prl_cuda::BlockSum(local_sum);  // its barriers also publish sc[] to the block
  for (int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    float acc = 0.0f;
    for (int64_t s = first; s < length; ++s) acc += sc[s] * prl_cuda::ToFloat(values[s * d + i]);
    out[(bi * heads + h) * d + i] = acc / total;
  }
}

}  // namespace

cudaError_t prl_cuda::DecodeAttention(const float* q, const void* cache_k, const void* cache_v, KvDtype cache,
                                      const int64_t* start, float* scores, float* out, int64_t b, int64_t heads,
                                      int64_t kv, int64_t cap, int64_t d, int64_t length, float scale,
                                      cudaStream_t stream) {
  if (b == 0 || heads == 0) return cudaGetLastError();
  dim3 grid(static_cast<unsigned>(b), static_cast<unsigned>(heads));
  ForKvDtype(cache, [&](auto zero) {
    using T = decltype(zero);
    DecodeAttentionKernel<T><<<grid, 128, 0, stream>>>(q, static_cast<const T*>(cache_k),
                                                        static_cast<const T*>(cache_v), start, scores, out, heads, kv,
                                                        cap, d, length, scale);
  });
  return cudaGetLastError();
}

#ifndef PRL_NO_PADDLE
std::vector<paddle::Tensor> DecodeAttentionCUDA(const paddle::Tensor& q, const paddle::Tensor& cache_k,
                                                const paddle::Tensor& cache_v, const paddle::Tensor& start,
                                                int64_t length, float scale) {
  const char* op = "prl_decode_attention";
  const auto& qs = q.shape();
  const auto& cs = cache_k.shape();
  const int64_t b = qs[0], heads = qs[2], d = qs[3], kv = cs[1], cap = cs[2];
  PD_CHECK(length >= 1 && length <= cap && heads % kv == 0, "prl_decode_attention: bad length or heads");
  const prl_cuda::KvDtype cache = prl_cuda::CacheDtype(cache_k, cache_v, op);
  auto out = paddle::empty({b, 1, heads * d}, q.dtype(), q.place());
  auto scores = paddle::empty({static_cast<int64_t>(prl_cuda::DecodeAttentionScratch(b, heads, cap))},
                              paddle::DataType::FLOAT32, q.place());
  prl_cuda::CheckLaunch(
      prl_cuda::DecodeAttention(q.data<float>(), cache_k.data(), cache_v.data(), cache, start.data<int64_t>(),
                                scores.data<float>(), out.data<float>(), b, heads, kv, cap, d, length, scale,
                                q.stream()),
      op);
  return {out};
}
#endif  // PRL_NO_PADDLE
