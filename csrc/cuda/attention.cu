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

std::vector<paddle::Tensor> DecodeAttentionCUDA(const paddle::Tensor& q, const paddle::Tensor& cache_k,
                                                const paddle::Tensor& cache_v, const paddle::Tensor& start,
                                                int64_t length, float scale) {
  const auto& qs = q.shape();
  const auto& cs = cache_k.shape();
  const int64_t b = qs[0], heads = qs[2], d = qs[3], kv = cs[1], cap = cs[2];
  PD_CHECK(length >= 1 && length <= cap && heads % kv == 0, "prl_decode_attention: bad length or heads");
  auto out = paddle::empty({b, 1, heads * d}, q.dtype(), q.place());
  auto scores = paddle::empty({b * heads * cap}, paddle::DataType::FLOAT32, q.place());
  dim3 grid(static_cast<unsigned>(b), static_cast<unsigned>(heads));
  prl_cuda::ForCacheType(cache_k, cache_v, "prl_decode_attention", [&](auto zero) {
    using T = decltype(zero);
    if (b > 0)
      DecodeAttentionKernel<T><<<grid, 128, 0, q.stream()>>>(
          q.data<float>(), reinterpret_cast<const T*>(cache_k.data()), reinterpret_cast<const T*>(cache_v.data()),
          start.data<int64_t>(), scores.data<float>(), out.data<float>(), heads, kv, cap, d, length, scale);
  });
  prl_cuda::CheckLaunch("prl_decode_attention");
  return {out};
}
