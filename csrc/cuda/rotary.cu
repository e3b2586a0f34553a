// CUDA rotary embedding and the decode step's qkv split + rotary + KV-cache write (see csrc/cpu/rotary.cc).
#include "prl_cuda.cuh"

namespace {

__global__ void RotaryKernel(const float* x, const float* cos, const float* sin, float* out, int64_t total,
                             int64_t l, int64_t heads, int64_t d, int64_t table_batch, bool inverse) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= total) return;
  const int64_t half = d / 2, i = idx % d, row = idx / (d * heads), bi = row / l, li = row % l;
  const int64_t table = ((table_batch == 1 ? 0 : bi) * l + li) * d;
  const float c = cos[table + i];
  if (!inverse) {
    out[idx] = i < half ? x[idx] * c + (-x[idx + half]) * sin[table + i] : x[idx] * c + x[idx - half] * sin[table + i];
  } else {
    out[idx] = i < half ? x[idx] * c + x[idx + half] * sin[table + i + half]
                        : x[idx] * c - x[idx - half] * sin[table + i - half];
  }
}

// grid (B * L, H + KV), block >= head_dim threads (a multiple of 32).
template <typename T>
__global__ void RotaryQkvCacheKernel(const float* qkv, const int64_t* positions, const float* inv_freq, float* q,
                                     T* cache_k, T* cache_v, const float* q_norm, const float* k_norm,
                                     int num_heads, int num_kv_heads, int64_t l, int64_t d, int64_t cap,
                                     int64_t slot, float eps) {
  const int64_t row = blockIdx.x, bi = row / l, li = row % l, half = d / 2;
  const int head = blockIdx.y;
  const bool is_q = head < num_heads;
  const int g = is_q ? 0 : head - num_heads;
  const int64_t width = (num_heads + 2 * num_kv_heads) * d;
  const float* src = qkv + row * width + (is_q ? head * d : (num_heads + g) * d);
  const float* norm = is_q ? q_norm : k_norm;
  const int i = threadIdx.x;
  float v = i < d ? src[i] : 0.0f;
  float r = 1.0f;
  if (norm != nullptr) r = rsqrtf(prl_cuda::BlockSum(v * v) / d + eps);
  if (i >= d) return;
  const int64_t partner = i < half ? i + half : i - half;
  const float w_i = norm != nullptr ? norm[i] : 1.0f, w_p = norm != nullptr ? norm[partner] : 1.0f;
  const float own = norm != nullptr ? (v * r) * w_i : v;
  const float other = norm != nullptr ? (src[partner] * r) * w_p : src[partner];
  // the angle in float32 as on the CPU, its cosine and sine in float64: --use_fast_math turns cosf / sinf into
  // cos.approx / sin.approx, whose error is bounded only for |angle| <= 100 pi (positions reach thousands)
  const float angle = static_cast<float>(positions[row]) * inv_freq[i % half];
  double sd, cd;
  sincos(static_cast<double>(angle), &sd, &cd);
  const float c = static_cast<float>(cd), s = static_cast<float>(sd);
  const float rotated = i < half ? own * c + (-other) * s : own * c + other * s;
  if (is_q) {
    q[(row * num_heads + head) * d + i] = rotated;
  } else {
    const int64_t at = ((bi * num_kv_heads + g) * cap + slot + li) * d + i;
    prl_cuda::FromFloat(rotated, cache_k + at);
    prl_cuda::FromFloat(qkv[row * width + (num_heads + num_kv_heads + g) * d + i], cache_v + at);
  }
}

}  // namespace

cudaError_t prl_cuda::Rotary(const float* x, const float* cos, const float* sin, float* out, int64_t b, int64_t l,
                             int64_t heads, int64_t d, int64_t table_batch, bool inverse, cudaStream_t stream) {
  const int64_t total = b * l * heads * d;
  if (total > 0)
    RotaryKernel<<<Blocks(total), kThreads, 0, stream>>>(x, cos, sin, out, total, l, heads, d, table_batch, inverse);
  return cudaGetLastError();
}

cudaError_t prl_cuda::RotaryQkvCache(const float* qkv, const int64_t* positions, const float* inv_freq, float* q,
                                     void* cache_k, void* cache_v, KvDtype cache, const float* q_norm,
                                     const float* k_norm, int64_t b, int64_t l, int num_heads, int num_kv_heads,
                                     int64_t d, int64_t cap, int64_t slot, float eps, cudaStream_t stream) {
  const int threads = static_cast<int>((d + 31) / 32 * 32);
  if (threads > 1024) return cudaErrorInvalidValue;
  if (b * l == 0 || num_heads + num_kv_heads == 0) return cudaGetLastError();
  dim3 grid(static_cast<unsigned>(b * l), static_cast<unsigned>(num_heads + num_kv_heads));
  ForKvDtype(cache, [&](auto zero) {
    using T = decltype(zero);
    RotaryQkvCacheKernel<T><<<grid, threads, 0, stream>>>(qkv, positions, inv_freq, q, static_cast<T*>(cache_k),
                                                          static_cast<T*>(cache_v), q_norm, k_norm, num_heads,
                                                          num_kv_heads, l, d, cap, slot, eps);
  });
  return cudaGetLastError();
}

#ifndef PRL_NO_PADDLE
std::vector<paddle::Tensor> RotaryForwardCUDA(const paddle::Tensor& x, const paddle::Tensor& cos,
                                              const paddle::Tensor& sin, bool inverse) {
  const auto& s = x.shape();
  PD_CHECK(s.size() == 4, "prl_rotary: x must be [B, L, H, D]");
  const int64_t l = s[1], d = s[3];
  const int64_t table_batch = cos.numel() / (l * d);
  auto out = paddle::empty(s, x.dtype(), x.place());
  prl_cuda::CheckLaunch(prl_cuda::Rotary(x.data<float>(), cos.data<float>(), sin.data<float>(), out.data<float>(),
                                         s[0], l, s[2], d, table_batch, inverse, x.stream()),
                        "prl_rotary");
  return {out};
}

std::vector<paddle::Tensor> RotaryQkvCacheCUDA(const paddle::Tensor& qkv, const paddle::Tensor& positions,
                                               const paddle::Tensor& inv_freq, paddle::Tensor& cache_k,
                                               paddle::Tensor& cache_v, const paddle::optional<paddle::Tensor>& q_norm,
                                               const paddle::optional<paddle::Tensor>& k_norm, int num_heads,
                                               int num_kv_heads, int64_t slot, float eps) {
  const char* op = "prl_rotary_qkv_cache";
  const auto& s = qkv.shape();
  const auto& cs = cache_k.shape();
  const int64_t b = s[0], l = s.size() == 3 ? s[1] : 1, d = cs[3], cap = cs[2];
  PD_CHECK(slot >= 0 && slot + l <= cap, "prl_rotary_qkv_cache: slots outside the cache");
  PD_CHECK((d + 31) / 32 * 32 <= 1024, "prl_rotary_qkv_cache: head_dim too large");
  const prl_cuda::KvDtype cache = prl_cuda::CacheDtype(cache_k, cache_v, op);
  auto q = paddle::empty({b, l, num_heads, d}, qkv.dtype(), qkv.place());
  prl_cuda::CheckLaunch(
      prl_cuda::RotaryQkvCache(qkv.data<float>(), positions.data<int64_t>(), inv_freq.data<float>(), q.data<float>(),
                               cache_k.data(), cache_v.data(), cache, q_norm ? q_norm->data<float>() : nullptr,
                               k_norm ? k_norm->data<float>() : nullptr, b, l, num_heads, num_kv_heads, d, cap, slot,
                               eps, qkv.stream()),
      op);
  return {q};
}
#endif  // PRL_NO_PADDLE
