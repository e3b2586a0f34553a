// One decode step of grouped-query attention against the preallocated KV cache.
//   q [B, 1, H, D] float32; cache_k, cache_v [B, KV, C, D] float32, bfloat16 or float16 (read as float32);
//   start [B] int64: row b attends to slots start[b] .. length - 1
//   (its left padding is skipped); out [B, 1, H * D]. Query head h reads kv head h / (H / KV).
#include <algorithm>
#include <type_traits>
#include <utility>

#include "../prl_common.h"
#include "kernels.h"

namespace {

constexpr int64_t kHeadBlock = 4;  // query heads of a group that share each load (and conversion) of a key or value

// Ask for the cache lines of one row of d elements.
template <typename T>
inline void Prefetch(const T* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < d * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off, 0, 3);
}

// Vector accumulators a block keeps in registers: 32 vector registers with AVX-512, else 16, less the loaded rows
// (a key block's NK, q read from memory) or the loaded row and its broadcast weight (a value tile's NV + 1).
#ifdef __AVX512F__
constexpr int kScoreAccumulators = 24, kValueAccumulators = 24;
#else
constexpr int kScoreAccumulators = 12, kValueAccumulators = 8;
#endif

// Keys scored together by a block of M heads: M x NK independent dot products (the loads of a key row serve M
// heads, and no product waits on the one before it), reduced NK at a time.
template <int M>
constexpr int KeyBlock() {
  return M * 8 <= kScoreAccumulators ? 8 : M * 4 <= kScoreAccumulators ? 4 : 2;
}

// out[j * stride + i] = scale * (q_j . k_i) for the M query heads of a block (q: M rows of d floats) and NK keys
// (k: NK rows of d elements); d % 8 == 0.
template <int M, int NK, typename T>
inline void Score(const float* q, const T* k, int64_t d, float scale, float* out, int64_t stride) {
  prl::V8 a[M][NK] = {};
  for (int64_t c = 0; c < d; c += 8) {
    prl::V8 x[NK];
    for (int i = 0; i < NK; ++i) x[i] = prl::Load8(k + i * d + c);
    for (int j = 0; j < M; ++j) {
      const prl::V8 y = prl::Load8(q + j * d + c);
      for (int i = 0; i < NK; ++i) a[j][i] += y * x[i];
    }
  }
  for (int j = 0; j < M; ++j) prl::HSums<NK>(a[j], scale, out + j * stride);
}

// acc_j[0 : 8 NV] = sum_s p[j * stride + s] * v_s[0 : 8 NV] over a window's n slots for the M heads of a block
// (v: rows of d elements, offset to the tile's first column; acc: M rows of d floats, offset alike). The M x NV
// accumulators stay in registers over all the slots; fetches the first next_n rows of next (the next window) along.
template <int M, int NV, typename T>
inline void AccumulateTile(const T* v, const float* p, int64_t stride, int64_t d, int64_t n, float* acc,
                           const T* next, int64_t next_n) {
  prl::V8 a[M][NV] = {};
  for (int64_t s = 0; s < n; ++s) {
    if (s < next_n) Prefetch(next + s * d, d);
    prl::V8 x[NV];
    for (int i = 0; i < NV; ++i) x[i] = prl::Load8(v + s * d + 8 * i);
    for (int j = 0; j < M; ++j) {
      const float w = p[j * stride + s];
      for (int i = 0; i < NV; ++i) a[j][i] += w * x[i];
    }
  }
  for (int j = 0; j < M; ++j) std::memcpy(acc + j * d, a[j], sizeof(a[j]));
}

// The same over whole rows for any d % 8 == 0, the accumulators in memory (L1): each value row is read once, in
// order, which keeps a window too wide for the registers streaming at the memory's rate.
template <int M, typename T>
inline void AccumulateInMemory(const T* v, const float* p, int64_t stride, int64_t d, int64_t n, float* acc,
                               const T* next, int64_t next_n) {
  std::fill(acc, acc + M * d, 0.0f);
  for (int64_t s = 0; s < n; ++s) {
    if (s < next_n) Prefetch(next + s * d, d);
    for (int64_t c = 0; c < d; c += 8) {
      const prl::V8 x = prl::Load8(v + s * d + c);
      for (int j = 0; j < M; ++j) {
        const prl::V8 r = prl::Load8(acc + j * d + c) + p[j * stride + s] * x;
        std::memcpy(acc + j * d + c, &r, sizeof(r));
      }
    }
  }
}

// A window whose value rows fit in the L2 cache (at most kTiledBytes) is passed once per column tile.
constexpr int64_t kTiledBytes = 256 << 10;

template <int M, typename T>
inline void Accumulate(const T* v, const float* p, int64_t stride, int64_t d, int64_t n, float* acc, const T* next,
                       int64_t next_n) {
  // a whole row in one tile where its accumulators fit in the registers
  if constexpr (M * 8 <= kValueAccumulators) {
    if (d == 64) return AccumulateTile<M, 8>(v, p, stride, d, n, acc, next, next_n);
  }
  if constexpr (M * 4 <= kValueAccumulators) {
    if (d == 32) return AccumulateTile<M, 4>(v, p, stride, d, n, acc, next, next_n);
  }
  constexpr int NV = M * 4 <= kValueAccumulators ? 4 : 2;
  if (d % (8 * NV) != 0 || n * d * static_cast<int64_t>(sizeof(T)) > kTiledBytes) {
    return AccumulateInMemory<M>(v, p, stride, d, n, acc, next, next_n);
  }
  for (int64_t c = 0; c < d; c += 8 * NV) {
    AccumulateTile<M, NV>(v + c, p, stride, d, n, acc + c, next, c == 0 ? next_n : 0);
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
inline void AccumulateScalar(const T* v, const float* p, int64_t stride, int64_t d, int64_t n, float* acc) {
  std::fill(acc, acc + M * d, 0.0f);
  for (int64_t s = 0; s < n; ++s) {
    for (int64_t i = 0; i < d; ++i) {
      const float x = prl::ToFloat(v[s * d + i]);
      for (int j = 0; j < M; ++j) acc[j * d + i] += p[j * stride + s] * x;
    }
  }
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
    for (int64_t j0 = 0; j0 < groups; j0 += kHeadBlock) {
      ForBlock(groups, j0, [&](auto m) {
        constexpr int M = decltype(m)::value;
        constexpr int NK = KeyBlock<M>();
        const float* q = q0 + j0 * d;
        float* o = scores.data() + j0 * cap;
        int64_t s = 0;
        if (wide) {
          for (; s + NK <= n; s += NK) {
            if (j0 == 0) {
              for (int64_t i = s; i < std::min(s + NK, next_n); ++i) Prefetch(next_keys + i * d, d);
            }
            Score<M, NK>(q, keys + s * d, d, scale, o + s, cap);
          }
          for (; s < n; ++s) Score<M, 1>(q, keys + s * d, d, scale, o + s, cap);
        } else {
          for (; s < n; ++s) ScoreScalar<M>(q, keys + s * d, d, scale, o + s, cap);
        }
      });
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
    for (int64_t j0 = 0; j0 < groups; j0 += kHeadBlock) {
      ForBlock(groups, j0, [&](auto m) {
        constexpr int M = decltype(m)::value;
        const float* p = scores.data() + j0 * cap;
        if (wide) Accumulate<M>(values, p, cap, d, n, acc.data() + j0 * d, next_values, j0 == 0 ? next_n : 0);
        else AccumulateScalar<M>(values, p, cap, d, n, acc.data() + j0 * d);
      });
    }
    for (int64_t j = 0; j < groups; ++j) {
      float* o = out + (bi * heads + g * groups + j) * d;
      for (int64_t i = 0; i < d; ++i) o[i] = acc[j * d + i] * inv[j];
    }
  }
}

}  // namespace

void prl_cpu::DecodeAttention(const float* qp, const void* cache_k, const void* cache_v, KvDtype cache,
                              const int64_t* st, float* o, int64_t b, int64_t heads, int64_t kv, int64_t cap,
                              int64_t d, int64_t length, float scale) {
  // (row, kv head) items in parallel, each part with its own scratch
  prl::ForKvDtype(cache, [&](auto zero) {
    using T = decltype(zero);
    const T* kp = static_cast<const T*>(cache_k);
    const T* vp = static_cast<const T*>(cache_v);
    prl::ParallelFor(b * kv, 2 * heads / kv * length * d, [&](int, int64_t begin, int64_t end) {
      Attend(qp, kp, vp, st, o, begin, end, heads, kv, cap, d, length, scale);
    });
  });
}

#ifndef PRL_NO_PADDLE
#ifdef PRL_WITH_CUDA
std::vector<paddle::Tensor> DecodeAttentionCUDA(const paddle::Tensor& q, const paddle::Tensor& cache_k,
                                                const paddle::Tensor& cache_v, const paddle::Tensor& start,
                                                int64_t length, float scale);
#endif

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
  const prl::KvDtype cache = prl::CpuCacheDtype(cache_k, cache_v, op);
  auto out = paddle::empty({b, 1, heads * d}, q.dtype(), q.place());
  prl_cpu::DecodeAttention(q.data<float>(), cache_k.data(), cache_v.data(), cache, start.data<int64_t>(),
                           out.data<float>(), b, heads, kv, cap, d, length, scale);
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
#endif  // PRL_NO_PADDLE
