// Rotate-half rotary embedding.
//   prl_rotary:           out = x * cos + rotate_half(x) * sin for x [B, L, H, D], cos/sin [B or 1, L, 1, D]
//                         (with its backward).
//   prl_rotary_qkv_cache: the decode step's attention input in one pass: split the fused qkv projection
//                         [B, L, (H + 2 KV) * D], optionally RMS-normalize q and k per head (Qwen3), rotate q and
//                         k by position * inv_freq, return q [B, L, H, D] and write k, v into the preallocated
//                         caches [B, KV, C, D] at slots slot .. slot + L - 1 (in place). The caches are float32,
//                         bfloat16 or float16 (written rounded to nearest even, as Paddle's cast).
#include "../prl_common.h"
#include "kernels.h"

namespace {

inline void NormRotate(const float* src, float* dst, const float* norm_w, float eps, const float* c, const float* s,
                       int64_t d, float* tmp) {
  const int64_t half = d / 2;
  const float* v = src;
  if (norm_w != nullptr) {
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < d; ++i) ss += static_cast<double>(src[i]) * src[i];
    const float r = 1.0f / std::sqrt(static_cast<float>(ss / d) + eps);
    for (int64_t i = 0; i < d; ++i) tmp[i] = (src[i] * r) * norm_w[i];
    v = tmp;
  }
  for (int64_t i = 0; i < half; ++i) dst[i] = v[i] * c[i] + (-v[i + half]) * s[i];
  for (int64_t i = half; i < d; ++i) dst[i] = v[i] * c[i] + v[i - half] * s[i];
}

}  // namespace

// inverse = false: out_i = x_i c_i - x_{i+h} s_i (i < h), x_i c_i + x_{i-h} s_i (i >= h)
// inverse = true (the backward): out_i = x_i c_i + x_{i+h} s_{i+h} (i < h), x_i c_i - x_{i-h} s_{i-h} (i >= h)
void prl_cpu::Rotary(const float* xp, const float* cp, const float* sp, float* op, int64_t b, int64_t l,
                     int64_t heads, int64_t d, int64_t cb, bool inverse) {
  const int64_t half = d / 2;
  prl::ParallelFor(b * l, heads * d, [&](int, int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const int64_t bi = row / l, li = row % l;
      const float* c = cp + ((cb == 1 ? 0 : bi) * l + li) * d;
      const float* sn = sp + ((cb == 1 ? 0 : bi) * l + li) * d;
      for (int64_t h = 0; h < heads; ++h) {
        const float* xi = xp + (row * heads + h) * d;
        float* o = op + (row * heads + h) * d;
        if (!inverse) {
          for (int64_t i = 0; i < half; ++i) o[i] = xi[i] * c[i] + (-xi[i + half]) * sn[i];
          for (int64_t i = half; i < d; ++i) o[i] = xi[i] * c[i] + xi[i - half] * sn[i];
        } else {
          for (int64_t i = 0; i < half; ++i) o[i] = xi[i] * c[i] + xi[i + half] * sn[i + half];
          for (int64_t i = half; i < d; ++i) o[i] = xi[i] * c[i] - xi[i - half] * sn[i - half];
        }
      }
    }
  });
}

void prl_cpu::RotaryQkvCache(const float* src, const int64_t* pos, const float* freq, float* qp, void* cache_k,
                             void* cache_v, KvDtype cache, const float* qn, const float* kn, int64_t b, int64_t l,
                             int num_heads, int num_kv_heads, int64_t d, int64_t cap, int64_t slot, float eps) {
  const int64_t half = d / 2, width = (num_heads + 2 * num_kv_heads) * d;
  prl::ForKvDtype(cache, [&](auto zero) {
    using T = decltype(zero);
    T* kp = static_cast<T*>(cache_k);
    T* vp = static_cast<T*>(cache_v);
    // rows in parallel (each row's numbers are its own): a row costs ~1 us (d / 2 sines and cosines), so parts
    // start at 16 rows
    prl::ParallelFor(b * l, int64_t{1} << 14, [&](int, int64_t first, int64_t last) {
      std::vector<float> c(d), sn(d), tmp(d), rotated(d);
      for (int64_t row = first; row < last; ++row) {
        const int64_t bi = row / l, li = row % l;
        const float p = static_cast<float>(pos[row]);
        for (int64_t i = 0; i < half; ++i) {
          const float angle = p * freq[i];
          c[i] = c[i + half] = std::cos(angle);
          sn[i] = sn[i + half] = std::sin(angle);
        }
        const float* in = src + row * width;
        for (int64_t h = 0; h < num_heads; ++h)
          NormRotate(in + h * d, qp + (row * num_heads + h) * d, qn, eps, c.data(), sn.data(), d, tmp.data());
        const float* kin = in + num_heads * d;
        const float* vin = kin + num_kv_heads * d;
        for (int64_t g = 0; g < num_kv_heads; ++g) {
          const int64_t at = ((bi * num_kv_heads + g) * cap + slot + li) * d;
          NormRotate(kin + g * d, rotated.data(), kn, eps, c.data(), sn.data(), d, tmp.data());
          for (int64_t i = 0; i < d; ++i) {  // rounded to the cache's dtype as Paddle's cast would
            prl::FromFloat(rotated[i], kp + at + i);
            prl::FromFloat(vin[g * d + i], vp + at + i);
          }
        }
      }
    });
  });
}

#ifndef PRL_NO_PADDLE
#ifdef PRL_WITH_CUDA
std::vector<paddle::Tensor> RotaryForwardCUDA(const paddle::Tensor& x, const paddle::Tensor& cos,
                                              const paddle::Tensor& sin, bool inverse);
std::vector<paddle::Tensor> RotaryQkvCacheCUDA(const paddle::Tensor& qkv, const paddle::Tensor& positions,
                                               const paddle::Tensor& inv_freq, paddle::Tensor& cache_k,
                                               paddle::Tensor& cache_v, const paddle::optional<paddle::Tensor>& q_norm,
                                               const paddle::optional<paddle::Tensor>& k_norm, int num_heads,
                                               int num_kv_heads, int64_t slot, float eps);
#endif

namespace {

std::vector<paddle::Tensor> Rotate(const paddle::Tensor& x, const paddle::Tensor& cos, const paddle::Tensor& sin,
                                   bool inverse) {
#ifdef PRL_WITH_CUDA
  if (x.is_gpu()) return RotaryForwardCUDA(x, cos, sin, inverse);
#endif
  prl::CheckCpuFloat(x, "prl_rotary", "x");
  prl::CheckCpuFloat(cos, "prl_rotary", "cos");
  prl::CheckCpuFloat(sin, "prl_rotary", "sin");
  const auto& s = x.shape();
  PD_CHECK(s.size() == 4, "prl_rotary: x must be [B, L, H, D]");
  const int64_t b = s[0], l = s[1], heads = s[2], d = s[3];
  PD_CHECK(d % 2 == 0, "prl_rotary: head_dim must be even");
  const int64_t cb = cos.numel() / (l * d);
  PD_CHECK(cos.numel() == cb * l * d && (cb == 1 || cb == b) && sin.numel() == cos.numel(),
           "prl_rotary: cos/sin must be [B or 1, L, 1, D]");
  auto out = paddle::empty(s, x.dtype(), x.place());
  prl_cpu::Rotary(x.data<float>(), cos.data<float>(), sin.data<float>(), out.data<float>(), b, l, heads, d, cb,
                  inverse);
  return {out};
}

}  // namespace

std::vector<paddle::Tensor> RotaryForward(const paddle::Tensor& x, const paddle::Tensor& cos,
                                          const paddle::Tensor& sin) {
  return Rotate(x, cos, sin, false);
}

std::vector<paddle::Tensor> RotaryBackward(const paddle::Tensor& cos, const paddle::Tensor& sin,
                                           const paddle::Tensor& grad_out) {
  return Rotate(grad_out, cos, sin, true);
}

std::vector<std::vector<int64_t>> RotaryInferShape(const std::vector<int64_t>& x, const std::vector<int64_t>& c,
                                                   const std::vector<int64_t>& s) {
  return {x};
}

std::vector<paddle::DataType> RotaryInferDtype(paddle::DataType x, paddle::DataType c, paddle::DataType s) {
  return {x};
}

PD_BUILD_OP(prl_rotary)
    .Inputs({"X", "Cos", "Sin"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(RotaryForward))
    .SetInferShapeFn(PD_INFER_SHAPE(RotaryInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RotaryInferDtype));

PD_BUILD_GRAD_OP(prl_rotary)
    .Inputs({"Cos", "Sin", paddle::Grad("Out")})
    .Outputs({paddle::Grad("X")})
    .SetKernelFn(PD_KERNEL(RotaryBackward));

std::vector<paddle::Tensor> RotaryQkvCache(const paddle::Tensor& qkv, const paddle::Tensor& positions,
                                           const paddle::Tensor& inv_freq, paddle::Tensor& cache_k,
                                           paddle::Tensor& cache_v, const paddle::optional<paddle::Tensor>& q_norm,
                                           const paddle::optional<paddle::Tensor>& k_norm, int num_heads,
                                           int num_kv_heads, int64_t slot, float eps) {
#ifdef PRL_WITH_CUDA
  if (qkv.is_gpu())
    return RotaryQkvCacheCUDA(qkv, positions, inv_freq, cache_k, cache_v, q_norm, k_norm, num_heads, num_kv_heads,
                              slot, eps);
#endif
  const char* op = "prl_rotary_qkv_cache";
  prl::CheckCpuFloat(qkv, op, "qkv");
  prl::CheckCpuFloat(inv_freq, op, "inv_freq");
  PD_CHECK(positions.dtype() == paddle::DataType::INT64, op, ": positions must be int64");
  const auto& s = qkv.shape();
  const auto& cs = cache_k.shape();
  PD_CHECK(s.size() == 3 && cs.size() == 4, op, ": qkv [B, L, (H + 2 KV) * D], caches [B, KV, C, D]");
  const int64_t b = s[0], l = s[1], d = cs[3], cap = cs[2], half = d / 2;
  PD_CHECK(s[2] == (num_heads + 2 * num_kv_heads) * d, op, ": qkv width ", s[2], " != (", num_heads, " + 2 * ",
           num_kv_heads, ") * ", d);
  PD_CHECK(cs[0] == b && cs[1] == num_kv_heads && cache_v.shape() == cs, op, ": cache shape mismatch");
  PD_CHECK(slot >= 0 && slot + l <= cap, op, ": slots ", slot, "..", slot + l - 1, " outside the cache (", cap, ")");
  PD_CHECK(positions.numel() == b * l, op, ": positions must be [B, L]");
  PD_CHECK(inv_freq.numel() == half, op, ": inv_freq must have head_dim / 2 elements");
  const prl::KvDtype cache = prl::CpuCacheDtype(cache_k, cache_v, op);
  auto q = paddle::empty({b, l, num_heads, d}, qkv.dtype(), qkv.place());
  prl_cpu::RotaryQkvCache(qkv.data<float>(), positions.data<int64_t>(), inv_freq.data<float>(), q.data<float>(),
                          cache_k.data(), cache_v.data(), cache, q_norm ? q_norm->data<float>() : nullptr,
                          k_norm ? k_norm->data<float>() : nullptr, b, l, num_heads, num_kv_heads, d, cap, slot, eps);
  return {q};
}

std::vector<std::vector<int64_t>> RotaryQkvCacheInferShape(
    const std::vector<int64_t>& qkv, const std::vector<int64_t>& positions, const std::vector<int64_t>& inv_freq,
    const std::vector<int64_t>& cache_k, const std::vector<int64_t>& cache_v,
    const paddle::optional<std::vector<int64_t>>& q_norm, const paddle::optional<std::vector<int64_t>>& k_norm,
    int num_heads, int num_kv_heads, int64_t slot, float eps) {
  return {{qkv[0], qkv[1], num_heads, cache_k[3]}, cache_k, cache_v};
}

std::vector<paddle::DataType> RotaryQkvCacheInferDtype(paddle::DataType qkv, paddle::DataType positions,
                                                       paddle::DataType inv_freq, paddle::DataType cache_k,
                                                       paddle::DataType cache_v,
                                                       const paddle::optional<paddle::DataType>& q_norm,
                                                       const paddle::optional<paddle::DataType>& k_norm) {
  return {qkv, cache_k, cache_v};
}

PD_BUILD_OP(prl_rotary_qkv_cache)
    .Inputs({"Qkv", "Positions", "InvFreq", "CacheK", "CacheV", paddle::Optional("QNorm"), paddle::Optional("KNorm")})
    .Outputs({"Q", "CacheKOut", "CacheVOut"})
    .Attrs({"num_heads: int", "num_kv_heads: int", "slot: int64_t", "eps: float"})
    .SetInplaceMap({{"CacheK", "CacheKOut"}, {"CacheV", "CacheVOut"}})
    .SetKernelFn(PD_KERNEL(RotaryQkvCache))
    .SetInferShapeFn(PD_INFER_SHAPE(RotaryQkvCacheInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RotaryQkvCacheInferDtype));
#endif  // PRL_NO_PADDLE
