// One decode step of grouped-query attention against the preallocated KV cache.
//   q [B, 1, H, D] float32; cache_k, cache_v [B, KV, C, D] float32, bfloat16 or float16 (read as float32);
//   start [B] int64: row b attends to slots start[b] .. length - 1
//   (its left padding is skipped); out [B, 1, H * D]. Query head h reads kv head h / (H / KV).
#include <algorithm>
#include <type_traits>
#include <utility>

#include "../prl_common.h"

#ifdef PRL_WITH_CUDA
std::vector<paddle::Tensor> DecodeAttentionCUDA(const paddle::Tensor& q, const paddle::Tensor& cache_k,
                                                const paddle::Tensor& cache_v, const paddle::Tensor& start,
                                                int64_t length, float scale);
#endif

namespace {

constexpr int64_t kHeadBlock = 4;  // query heads of a group that share each load (and conversion) of a key or value

// out[j * stride] = scale * (q_j . k) for the M query heads of a block (q: M rows of d floats; d % 8 == 0)
template <int M, typename T>
inline void Score(const float* q, const T* k, int64_t d, float scale, float* out, int64_t stride) {
  prl::V8 a[M] = {};
  for (int64_t c = 0; c < d; c += 8) {
    const prl::V8 x = prl::Load8(k + c);
    for (int j = 0; j < M; ++j) a[j] += prl::Load8(q + j * d + c) * x;
  }
  for (int j = 0; j < M; ++j) out[j * stride] = prl::HSum8(a[j]) * scale;
}

// acc_j += p[j * stride] * v for the M heads of a block (acc: M rows of d floats; d % 8 == 0)
template <int M, typename T>
inline void Accumulate(const T* v, const float* p, int64_t stride, int64_t d, float* acc) {
  for (int64_t c = 0; c < d; c += 8) {
    const prl::V8 x = prl::Load8(v + c);
    for (int j = 0; j < M; ++j) {
      const prl::V8 r = prl::Load8(acc + j * d + c) + p[j * stride] * x;
      std::memcpy(acc + j * d + c, &r, sizeof(r));
    }
  }
}

// Any head_dim: one element at a time.
template <int M, typename T>
inline void ScoreScalar(const float* q, const T* k, int64_t d, float scale, float* out, int64_t stride) {
  for (int j = 0; j < M; ++j) {
    float dot = 0.0f;
    for (int64_t i = 0; i < d; ++i) dot += q[j * d + i] * prl::ToFloat(k[i]);
    out[j * stride] = dot * scale;
  }
}

template <int M, typename T>
inline void AccumulateScalar(const T* v, const float* p, int64_t stride, int64_t d, float* acc) {
  for (int64_t i = 0; i < d; ++i) {
    const float x = prl::ToFloat(v[i]);
    for (int j = 0; j < M; ++j) acc[j * d + i] += p[j * stride] * x;
  }
}

// Ask for the cache lines of one row of d elements.
template <typename T>
inline void Prefetch(const T* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < d * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off, 0, 3);
}

// fn.template operator()<M>() for the size M of the head block starting at j0
template <typename Fn>
inline void ForBlock(int64_t groups, int64_t j0, Fn&& fn) {
  switch (std::min(kHeadBlock, groups - j0)) {
    case 4: return fn(std::integral_constant<int, 4>());
    case 3: return fn(std::integral_constant<int, 3>());
    case 2: return fn(std::integral_constant<int, 2>());
    default: return fn(std::integral_constant<int, 1>());
  }
}

// The (row, kv head) items [begin, end); T: the cache's element type.
template <typename T>
void Attend(const float* qp, const T* kp, const T* vp, const int64_t* st, float* out, int64_t begin, int64_t end,
            int64_t heads, int64_t kv, int64_t cap, int64_t d, int64_t length, float scale) {
  const int64_t groups = heads / kv;
  const bool wide = d % 8 == 0;
  std::vector<float> scores(static_cast<size_t>(groups) * cap), acc(static_cast<size_t>(groups) * d), inv(groups);
  // the window of item (row, kv head): its first slot's offset in the caches and its number of slots
  auto window = [&](int64_t item) {
    const int64_t bi = item / kv, g = item % kv;
    const int64_t first = std::min<int64_t>(std::max<int64_t>(st[bi], 0), length - 1);
    return std::make_pair(((bi * kv + g) * cap + first) * d, length - first);
  };
  for (int64_t item = begin; item < end; ++item) {
    const int64_t bi = item / kv, g = item % kv;
    // slots are counted from the row's first one, so a row's result does not depend on where its window sits in
    // the cache or on the rows beside it
    const auto [at, n] = window(item);
    const T* keys = kp + at;
    const T* values = vp + at;
    const float* q0 = qp + (bi * heads + g * groups) * d;  // the group's query heads are adjacent
    // the next item's window is a new stream: fetch its rows while this item's are read
    const auto [next_at, next_n] = item + 1 < end ? window(item + 1) : std::make_pair(int64_t{0}, int64_t{0});
    const T* next_keys = kp + next_at;
    const T* next_values = vp + next_at;
    for (int64_t s = 0; s < n; ++s) {
      if (s < next_n) Prefetch(next_keys + s * d, d);
      for (int64_t j0 = 0; j0 < groups; j0 += kHeadBlock) {
        ForBlock(groups, j0, [&](auto m) {
          constexpr int M = decltype(m)::value;
          float* o = scores.data() + j0 * cap + s;
          if (wide) Score<M>(q0 + j0 * d, keys + s * d, d, scale, o, cap);
          else ScoreScalar<M>(q0 + j0 * d, keys + s * d, d, scale, o, cap);
        });
      }
    }
    for (int64_t j = 0; j < groups; ++j) {
      float* sc = scores.data() + j * cap;
      float mx = -3.0e38f;
      for (int64_t s = 0; s < n; ++s) mx = std::max(mx, sc[s]);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t s = 0; s < n; ++s) {
        sc[s] = prl::ExpF(sc[s] - mx);
        sum += sc[s];
      }
      inv[j] = 1.0f / sum;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t s = 0; s < n; ++s) {
      if (s < next_n) Prefetch(next_values + s * d, d);
      for (int64_t j0 = 0; j0 < groups; j0 += kHeadBlock) {
        ForBlock(groups, j0, [&](auto m) {
          constexpr int M = decltype(m)::value;
          const float* p = scores.data() + j0 * cap + s;
          if (wide) Accumulate<M>(values + s * d, p, cap, d, acc.data() + j0 * d);
          else AccumulateScalar<M>(values + s * d, p, cap, d, acc.data() + j0 * d);
        });
      }
    }
    for (int64_t j = 0; j < groups; ++j) {
      float* o = out + (bi * heads + g * groups + j) * d;
      for (int64_t i = 0; i < d; ++i) o[i] = acc[j * d + i] * inv[j];
    }
  }
}

}  // namespace

std::vector<paddle::Tensor> DecodeAttention(const paddle::Tensor& q, const paddle::Tensor& cache_k,
                                            const paddle::Tensor& cache_v, const paddle::Tensor& start, int64_t length,
                                            float scale) {
#ifdef PRL_WITH_CUDA
  if (q.is_gpu()) return DecodeAttentionCUDA(q, cache_k, cache_v, start, length, scale);
#endif
  const char* op = "prl_decode_attention";
  prl::CheckCpuFloat(q, op, "q");
  PD_CHECK(start.dtype() == paddle::DataType::INT64, op, ": start must be int64");
  const auto& qs = q.shape();
  const auto& cs = cache_k.shape();
  PD_CHECK(qs.size() == 4 && qs[1] == 1 && cs.size() == 4, op, ": q [B, 1, H, D], caches [B, KV, C, D]");
  const int64_t b = qs[0], heads = qs[2], d = qs[3], kv = cs[1], cap = cs[2];
  PD_CHECK(cs[0] == b && cs[3] == d && cache_v.shape() == cs && heads % kv == 0, op, ": shape mismatch");
  PD_CHECK(length >= 1 && length <= cap, op, ": length ", length, " outside the cache (", cap, ")");
  PD_CHECK(start.numel() == b, op, ": start must be [B]");
  auto out = paddle::empty({b, 1, heads * d}, q.dtype(), q.place());
  const float* qp = q.data<float>();
  const int64_t* st = start.data<int64_t>();
  float* o = out.data<float>();
  // (row, kv head) items in parallel, each part with its own scratch
  prl::ForCacheType(cache_k, cache_v, op, [&](auto zero) {
    using T = decltype(zero);
    const T* kp = static_cast<const T*>(cache_k.data());
    const T* vp = static_cast<const T*>(cache_v.data());
    prl::ParallelFor(b * kv, 2 * heads / kv * length * d, [&](int, int64_t begin, int64_t end) {
      Attend(qp, kp, vp, st, o, begin, end, heads, kv, cap, d, length, scale);
    });
  });
  return {out};
}

std::vector<std::vector<int64_t>> DecodeAttentionInferShape(const std::vector<int64_t>& q,
                                                            const std::vector<int64_t>& k,
                                                            const std::vector<int64_t>& v,
                                                            const std::vector<int64_t>& start, int64_t length,
                                                            float scale) {
  return {{q[0], 1, q[2] * q[3]}};
}

std::vector<paddle::DataType> DecodeAttentionInferDtype(paddle::DataType q, paddle::DataType k, paddle::DataType v,
                                                        paddle::DataType start) {
  return {q};
}

PD_BUILD_OP(prl_decode_attention)
    .Inputs({"Q", "CacheK", "CacheV", "Start"})
    .Outputs({"Out"})
    .Attrs({"length: int64_t", "scale: float"})
    .SetKernelFn(PD_KERNEL(DecodeAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(DecodeAttentionInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(DecodeAttentionInferDtype));
