// Rotate-half rotary embedding.
//   prl_rotary:           out = x * cos + rotate_half(x) * sin for x [B, L, H, D], cos/sin [B or 1, L, 1, D]
//                         (with its backward).
//   prl_rotary_qkv_cache: the decode step's attention input in one pass: split the fused qkv projection
//                         [B, L, (H + 2 KV) * D], optionally RMS-normalize q and k per head (Qwen3), rotate q and
//                         k by position * inv_freq, return q [B, L, H, D] and write k, v into the preallocated
//                         caches [B, KV, C, D] at slots slot .. slot + L - 1 (in place). The caches are float32,
//                         bfloat16 or float16 (written rounded to nearest even, as Paddle's cast).
//   prl_qkv_rotary:       the training passes' attention input in one pass (with its backward): the fused qkv
//                         projection [B, L, (H + 2 KV) * D] plus its bias (or an empty tensor: none), split, q and k
//                         rotated by cos/sin [B or 1, L, 1, D], each written head-major: q [B, H, L, D], k and v
//                         [B, KV, L, D]. The backward rotates back into the projection's gradient and sums that over
//                         the rows for the bias's (row by row in order, as Paddle's add backward: the same bits).
#include "../prl_common.h"
#include "kernels.h"

namespace {

// One head's rotate-half rotation (o and x distinct), the one expression every rotary kernel here uses, so their
// products and sums are the same bits. inverse = false: o_i = x_i c_i - x_{i+h} s_i (i < h), x_i c_i + x_{i-h} s_i
// (i >= h); inverse = true (the backward): o_i = x_i c_i + x_{i+h} s_{i+h} (i < h), x_i c_i - x_{i-h} s_{i-h} (i >= h).
inline void RotateHead(const float* xi, const float* c, const float* sn, float* o, int64_t d, bool inverse) {
  const int64_t half = d / 2;
  if (!inverse) {
    for (int64_t i = 0; i < half; ++i) o[i] = xi[i] * c[i] + (-xi[i + half]) * sn[i];
    for (int64_t i = half; i < d; ++i) o[i] = xi[i] * c[i] + xi[i - half] * sn[i];
  } else {
    for (int64_t i = 0; i < half; ++i) o[i] = xi[i] * c[i] + xi[i + half] * sn[i + half];
    for (int64_t i = half; i < d; ++i) o[i] = xi[i] * c[i] - xi[i - half] * sn[i - half];
  }
}

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

void prl_cpu::Rotary(const float* xp, const float* cp, const float* sp, float* op, int64_t b, int64_t l,
                     int64_t heads, int64_t d, int64_t cb, bool inverse) {
  prl::ParallelFor(b * l, heads * d, [&](int, int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const int64_t bi = row / l, li = row % l;
      const float* c = cp + ((cb == 1 ? 0 : bi) * l + li) * d;
      const float* sn = sp + ((cb == 1 ? 0 : bi) * l + li) * d;
      for (int64_t h = 0; h < heads; ++h)
        RotateHead(xp + (row * heads + h) * d, c, sn, op + (row * heads + h) * d, d, inverse);
    }
  });
}

namespace {

// prl_qkv_rotary's forward: x [b, l, (nh + 2 nkv) d] (+ bias [(nh + 2 nkv) d] or null) -> q [b, nh, l, d], k, v
// [b, nkv, l, d], q and k rotated by the tables [cb (1 or b), l, d]. Rows in parallel (each row's numbers are its
// own). Not a kernels.h launcher: the CUDA check covers those, and this one has no CUDA counterpart.
void QkvRotaryForward(const float* xp, const float* bias, const float* cp, const float* sp, float* qp, float* kp,
                      float* vp, int64_t b, int64_t l, int64_t nh, int64_t nkv, int64_t d, int64_t cb) {
  const int64_t width = (nh + 2 * nkv) * d;
  prl::ParallelFor(b * l, width, [&](int, int64_t first, int64_t last) {
    std::vector<float> tmp(d);
    for (int64_t row = first; row < last; ++row) {
      const int64_t bi = row / l, li = row % l;
      const float* c = cp + ((cb == 1 ? 0 : bi) * l + li) * d;
      const float* sn = sp + ((cb == 1 ? 0 : bi) * l + li) * d;
      const float* in = xp + row * width;
      for (int64_t h = 0; h < nh + 2 * nkv; ++h) {
        const float* src = in + h * d;
        float* dst = h < nh ? qp + ((bi * nh + h) * l + li) * d
                   : h < nh + nkv ? kp + ((bi * nkv + h - nh) * l + li) * d
                                  : vp + ((bi * nkv + h - nh - nkv) * l + li) * d;
        if (bias != nullptr) {   // the product's sum plus the bias, one float32 addition (Paddle's add)
          const float* bh = bias + h * d;
          float* t = h < nh + nkv ? tmp.data() : dst;
          for (int64_t i = 0; i < d; ++i) t[i] = src[i] + bh[i];
          src = t;
        }
        if (h < nh + nkv)
          RotateHead(src, c, sn, dst, d, false);
        else if (src != dst)
          std::memcpy(dst, src, d * sizeof(float));
      }
    }
  });
}

// The backward: gq, gk, gv (the outputs' layouts) -> gx [b, l, width] rotated back; gbias [width] (or null) the sum
// of gx over the rows, each column's in row order from zero (Paddle's add backward reduces so: the same bits),
// columns in parallel.
void QkvRotaryBackward(const float* gq, const float* gk, const float* gv, const float* cp, const float* sp,
                       float* gx, float* gbias, int64_t b, int64_t l, int64_t nh, int64_t nkv, int64_t d, int64_t cb) {
  const int64_t width = (nh + 2 * nkv) * d, rows = b * l;
  prl::ParallelFor(rows, width, [&](int, int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      const int64_t bi = row / l, li = row % l;
      const float* c = cp + ((cb == 1 ? 0 : bi) * l + li) * d;
      const float* sn = sp + ((cb == 1 ? 0 : bi) * l + li) * d;
      float* out = gx + row * width;
      for (int64_t h = 0; h < nh; ++h) RotateHead(gq + ((bi * nh + h) * l + li) * d, c, sn, out + h * d, d, true);
      for (int64_t g = 0; g < nkv; ++g) {
        RotateHead(gk + ((bi * nkv + g) * l + li) * d, c, sn, out + (nh + g) * d, d, true);
        std::memcpy(out + (nh + nkv + g) * d, gv + ((bi * nkv + g) * l + li) * d, d * sizeof(float));
      }
    }
  });
  if (gbias == nullptr) return;
  prl::ParallelFor(width, rows, [&](int, int64_t first, int64_t last) {
    float* acc = gbias + first;
    const int64_t n = last - first;
    std::fill(acc, acc + n, 0.0f);
    for (int64_t row = 0; row < rows; ++row) {
      const float* src = gx + row * width + first;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) acc[i] += src[i];
    }
  });
}

}  // namespace

namespace {
constexpr int64_t kSlotsAhead = 4;   // rows between a row's cache slots being fetched and written
}  // namespace

void prl_cpu::RotaryQkvCache(const float* src, const int64_t* pos, const float* freq, float* qp, void* cache_k,
                             void* cache_v, KvDtype cache, const float* qn, const float* kn, int64_t b, int64_t l,
                             int num_heads, int num_kv_heads, int64_t d, int64_t cap, int64_t slot, float eps) {
  const int64_t half = d / 2, width = (num_heads + 2 * num_kv_heads) * d;
  prl::ForKvDtype(cache, [&](auto zero) {
    using T = decltype(zero);
    T* kp = static_cast<T*>(cache_k);
    T* vp = static_cast<T*>(cache_v);
    // rows in parallel (each row's numbers are its own): a row costs ~1 us (d / 2 sines and cosines), so parts
    // start at 16 rows. A row at the position of the row before it takes that row's tables: in a decode step a
    // prompt's samples are neighbours at one position (the same numbers, computed once instead of n times).
    prl::ParallelFor(b * l, int64_t{1} << 14, [&](int, int64_t first, int64_t last) {
      std::vector<float> c(d), sn(d), tmp(d), rotated(d);
      bool tables = false;
      float tables_at = 0.0f;
      for (int64_t row = first; row < last; ++row) {
        const int64_t bi = row / l, li = row % l;
        const float p = static_cast<float>(pos[row]);
        if (!tables || p != tables_at) {
          for (int64_t i = 0; i < half; ++i) {
            const float angle = p * freq[i];
            c[i] = c[i + half] = std::cos(angle);
            sn[i] = sn[i + half] = std::sin(angle);
          }
          tables = true;
          tables_at = p;
        }
        // the cache slots a few rows ahead, fetched for writing now: each row writes its keys and values far
        // from the last row's (a row's cache is cap slots long), and waiting for those lines one store at a time
        // took about a third of this kernel's time in the quickstart's decode steps
        if (row + kSlotsAhead < last) {
          const int64_t ahead = row + kSlotsAhead;
          for (int64_t g = 0; g < num_kv_heads; ++g) {
            const int64_t at = (((ahead / l) * num_kv_heads + g) * cap + slot + ahead % l) * d;
            for (int64_t byte = 0; byte < d * static_cast<int64_t>(sizeof(T)); byte += 64) {
              __builtin_prefetch(reinterpret_cast<const char*>(kp + at) + byte, 1);
              __builtin_prefetch(reinterpret_cast<const char*>(vp + at) + byte, 1);
            }
          }
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

namespace {

// The sizes prl_qkv_rotary's forward and backward share, checked: (b, l, d, table batch).
std::vector<int64_t> QkvRotaryShape(const std::vector<int64_t>& x, const paddle::Tensor& bias, const paddle::Tensor& cos,
                                    const paddle::Tensor& sin, int num_heads, int num_kv_heads) {
  const char* op = "prl_qkv_rotary";
  prl::CheckCpuFloat(cos, op, "cos");
  prl::CheckCpuFloat(sin, op, "sin");
  PD_CHECK(x.size() == 3, op, ": qkv must be [B, L, (H + 2 KV) * D]");
  PD_CHECK(num_heads > 0 && num_kv_heads > 0 && x[2] % (num_heads + 2 * num_kv_heads) == 0, op, ": qkv width ",
           x[2], " is not a multiple of H + 2 KV = ", num_heads + 2 * num_kv_heads);
  const int64_t b = x[0], l = x[1], d = x[2] / (num_heads + 2 * num_kv_heads);
  PD_CHECK(d % 2 == 0, op, ": head_dim must be even");
  PD_CHECK(bias.numel() == 0 || bias.numel() == x[2], op, ": bias must have the qkv width's ", x[2],
           " elements (or none)");
  if (bias.numel() > 0) prl::CheckCpuFloat(bias, op, "bias");
  const int64_t cb = l * d > 0 ? cos.numel() / (l * d) : 1;
  PD_CHECK(cos.numel() == cb * l * d && (cb == 1 || cb == b) && sin.numel() == cos.numel(), op,
           ": cos/sin must be [B or 1, L, 1, D]");
  return {b, l, d, cb};
}

}  // namespace

std::vector<paddle::Tensor> QkvRotary(const paddle::Tensor& qkv, const paddle::Tensor& bias, const paddle::Tensor& cos,
                                      const paddle::Tensor& sin, int num_heads, int num_kv_heads) {
  prl::CheckCpuFloat(qkv, "prl_qkv_rotary", "qkv");
  const auto n = QkvRotaryShape(qkv.shape(), bias, cos, sin, num_heads, num_kv_heads);
  const int64_t b = n[0], l = n[1], d = n[2];
  auto q = paddle::empty({b, num_heads, l, d}, qkv.dtype(), qkv.place());
  auto k = paddle::empty({b, num_kv_heads, l, d}, qkv.dtype(), qkv.place());
  auto v = paddle::empty({b, num_kv_heads, l, d}, qkv.dtype(), qkv.place());
  QkvRotaryForward(qkv.data<float>(), bias.numel() > 0 ? bias.data<float>() : nullptr, cos.data<float>(),
                   sin.data<float>(), q.data<float>(), k.data<float>(), v.data<float>(), b, l, num_heads,
                   num_kv_heads, d, n[3]);
  return {q, k, v};
}

std::vector<paddle::Tensor> QkvRotaryGrad(const paddle::Tensor& bias, const paddle::Tensor& cos,
                                          const paddle::Tensor& sin, const paddle::Tensor& grad_q,
                                          const paddle::Tensor& grad_k, const paddle::Tensor& grad_v, int num_heads,
                                          int num_kv_heads) {
  const char* op = "prl_qkv_rotary_grad";
  for (const auto* g : {&grad_q, &grad_k, &grad_v}) prl::CheckCpuFloat(*g, op, "grad");
  const auto& gs = grad_q.shape();
  PD_CHECK(gs.size() == 4 && gs[1] == num_heads, op, ": grad of q must be [B, H, L, D]");
  const int64_t b = gs[0], l = gs[2], d = gs[3];
  const std::vector<int64_t> kv{b, num_kv_heads, l, d};
  PD_CHECK(grad_k.shape() == kv && grad_v.shape() == kv, op, ": grads of k, v must be [B, KV, L, D]");
  const auto n = QkvRotaryShape({b, l, (num_heads + 2 * num_kv_heads) * d}, bias, cos, sin, num_heads, num_kv_heads);
  auto gx = paddle::empty({b, l, (num_heads + 2 * num_kv_heads) * d}, grad_q.dtype(), grad_q.place());
  auto gbias = paddle::empty({bias.numel()}, grad_q.dtype(), grad_q.place());
  QkvRotaryBackward(grad_q.data<float>(), grad_k.data<float>(), grad_v.data<float>(), cos.data<float>(),
                    sin.data<float>(), gx.data<float>(), bias.numel() > 0 ? gbias.data<float>() : nullptr, b, l,
                    num_heads, num_kv_heads, d, n[3]);
  return {gx, gbias};
}

std::vector<std::vector<int64_t>> QkvRotaryInferShape(const std::vector<int64_t>& qkv, const std::vector<int64_t>& bias,
                                                      const std::vector<int64_t>& cos,
                                                      const std::vector<int64_t>& sin, int num_heads,
                                                      int num_kv_heads) {
  const int64_t d = qkv[2] / (num_heads + 2 * num_kv_heads);
  return {{qkv[0], num_heads, qkv[1], d}, {qkv[0], num_kv_heads, qkv[1], d}, {qkv[0], num_kv_heads, qkv[1], d}};
}

std::vector<paddle::DataType> QkvRotaryInferDtype(paddle::DataType qkv, paddle::DataType bias, paddle::DataType cos,
                                                  paddle::DataType sin) {
  return {qkv, qkv, qkv};
}

PD_BUILD_OP(prl_qkv_rotary)
    .Inputs({"Qkv", "Bias", "Cos", "Sin"})
    .Outputs({"Q", "K", "V"})
    .Attrs({"num_heads: int", "num_kv_heads: int"})
    .SetKernelFn(PD_KERNEL(QkvRotary))
    .SetInferShapeFn(PD_INFER_SHAPE(QkvRotaryInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(QkvRotaryInferDtype));

PD_BUILD_GRAD_OP(prl_qkv_rotary)
    .Inputs({"Bias", "Cos", "Sin", paddle::Grad("Q"), paddle::Grad("K"), paddle::Grad("V")})
    .Outputs({paddle::Grad("Qkv"), paddle::Grad("Bias")})
    .Attrs({"num_heads: int", "num_kv_heads: int"})
    .SetKernelFn(PD_KERNEL(QkvRotaryGrad));
#endif  // PRL_NO_PADDLE
