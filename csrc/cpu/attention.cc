// One decode step of grouped-query attention against the preallocated KV cache.
//   q [B, 1, H, D]; cache_k, cache_v [B, KV, C, D]; start [B] int64: row b attends to slots start[b] .. length - 1
//   (its left padding is skipped); out [B, 1, H * D]. Query head h reads kv head h / (H / KV).
#include <algorithm>

#include "../prl_common.h"

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
  prl::CheckCpuFloat(cache_k, op, "cache_k");
  prl::CheckCpuFloat(cache_v, op, "cache_v");
  PD_CHECK(start.dtype() == paddle::DataType::INT64, op, ": start must be int64");
  const auto& qs = q.shape();
  const auto& cs = cache_k.shape();
  PD_CHECK(qs.size() == 4 && qs[1] == 1 && cs.size() == 4, op, ": q [B, 1, H, D], caches [B, KV, C, D]");
  const int64_t b = qs[0], heads = qs[2], d = qs[3], kv = cs[1], cap = cs[2];
  PD_CHECK(cs[0] == b && cs[3] == d && cache_v.shape() == cs && heads % kv == 0, op, ": shape mismatch");
  PD_CHECK(length >= 1 && length <= cap, op, ": length ", length, " outside the cache (", cap, ")");
  PD_CHECK(start.numel() == b, op, ": start must be [B]");
  const int64_t groups = heads / kv;
  auto out = paddle::empty({b, 1, heads * d}, q.dtype(), q.place());
  const float* qp = q.data<float>();
  const float* kp = cache_k.data<float>();
  const float* vp = cache_v.data<float>();
  const int64_t* st = start.data<int64_t>();
  float* op_ = out.data<float>();
  const bool wide = d % 8 == 0;
  // (row, kv head) items in parallel, each part with its own scratch
  prl::ParallelFor(b * kv, 2 * groups * length * d, [&](int, int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(groups) * cap);
    std::vector<float> acc(d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t bi = item / kv, g = item % kv;
      const int64_t first = std::min<int64_t>(std::max<int64_t>(st[bi], 0), length - 1);
      const float* keys = kp + (bi * kv + g) * cap * d;
      const float* values = vp + (bi * kv + g) * cap * d;
      const float* q0 = qp + (bi * heads + g * groups) * d;  // the group's query heads are adjacent
      // scores of every query head of the group, reading each key once; the scratch is indexed from the row's
      // first slot, so the sums below see the same lanes wherever the row's window sits in the cache (a row's
      // result does not depend on its start slot or on the rows beside it)
      const int64_t n = length - first;
      for (int64_t s = 0; s < n; ++s) {
        const float* k = keys + (first + s) * d;
        for (int64_t j = 0; j < groups; ++j)
          scores[j * cap + s] = (wide ? prl::Dot8(q0 + j * d, k, d) : prl::Dot(q0 + j * d, k, d)) * scale;
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
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t s = 0; s < n; ++s) {
          const float p = sc[s];
          const float* v = values + (first + s) * d;
          for (int64_t i = 0; i < d; ++i) acc[i] += p * v[i];
        }
        float* o = op_ + (bi * heads + g * groups + j) * d;
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < d; ++i) o[i] = acc[i] * inv;
      }
    }
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
