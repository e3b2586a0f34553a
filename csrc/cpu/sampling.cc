// One decode step of sampling in a single pass per row:
//   repetition penalty (CTRL: seen tokens' logits divided by the penalty when positive, multiplied otherwise),
//   stop-token ban on the rows flagged in `ban`, then either argmax (temperature <= 0) or, in float64,
//   division by the temperature, top-k, top-p (keep every token at least as likely as the last one whose
//   preceding mass is below top_p), and an inverse-CDF draw with the row's uniform in [0, 1).
// Also returns log softmax(logits / temperature) at the drawn token (raw logits: the policy being trained).
// The arithmetic mirrors paddle_rl/ops/sampling.py (`sample_reference`) step for step; sums run in a different
// order (SIMD), which moves CDF steps by ~1e-15 relative.
#include <algorithm>
#include <functional>

#include "../prl_common.h"
#include "kernels.h"

namespace {

constexpr double kDropped = -1e9;  // what the reference writes for filtered tokens (probability exactly 0)

// A row's values as float64, read from an array of them (`Doubles`) or made on the fly from float32 logits times
// 1 / temperature (`Scaled`: the same products a float64 copy would hold, without writing and reading it again).
struct Doubles {
  const double* p;
  double At(int64_t i) const { return p[i]; }
  prl::V4D At4(int64_t i) const { return prl::Load4(p + i); }
};

struct Scaled {
  const float* x;
  double inv_t;
  double At(int64_t i) const { return static_cast<double>(x[i]) * inv_t; }
  prl::V4D At4(int64_t i) const {
    return prl::V4D{static_cast<double>(x[i]), static_cast<double>(x[i + 1]), static_cast<double>(x[i + 2]),
                    static_cast<double>(x[i + 3])} * inv_t;
  }
};

template <typename Row>
inline double MaxOf(const Row& z, int64_t n) {
  double m = z.At(0);
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = std::max(m, z.At(i));
  return m;
}

// e[i] = exp(z[i] - m) (ExpD4 4 lanes at a time, the rest by ExpD: equal bit for bit); returns the sum.
template <typename Row>
inline double ExpShifted(const Row& z, double m, double* e, int64_t n) {
  prl::V4D acc = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const prl::V4D x = prl::ExpD4(z.At4(i) - m);
    prl::Store4(e + i, x);
    acc += x;
  }
  double total = prl::HSum4(acc);
  for (; i < n; ++i) {
    e[i] = prl::ExpD(z.At(i) - m);
    total += e[i];
  }
  return total;
}

// A thread's scratch array of at least n elements, kept between calls (no allocation or zeroing per decode step).
template <typename T, int kSlot>
T* Scratch(int64_t n) {
  thread_local std::vector<T> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// First index whose cumulative probability e[0..i] / total exceeds u * (total mass); v - 1 if none.
inline int64_t InverseCdf(const double* e, double total, double u, int64_t v) {
  const double inv = 1.0 / total;
  const int64_t block = 64;
  double mass = 0.0;
#pragma omp simd reduction(+ : mass)
  for (int64_t i = 0; i < v; ++i) mass += e[i] * inv;
  const double threshold = u * mass;
  double cum = 0.0;
  for (int64_t start = 0; start < v; start += block) {
    const int64_t stop = std::min(v, start + block);
    double part = 0.0;
#pragma omp simd reduction(+ : part)
    for (int64_t i = start; i < stop; ++i) part += e[i] * inv;
    if (cum + part > threshold) {
      for (int64_t i = start; i < stop; ++i) {
        cum += e[i] * inv;
        if (cum > threshold) return i;
      }
      return stop - 1;
    }
    cum += part;
  }
  return v - 1;
}

}  // namespace

void prl_cpu::Sample(const float* xp, const float* sp, const float* up, const bool* bp, const int64_t* stop,
                     int64_t n_stop, int64_t* tp, float* lp, int64_t b, int64_t v, float temperature, int top_k,
                     float top_p, float penalty) {
  const bool greedy = temperature <= 0.0f;
  const bool penalize = sp != nullptr && penalty != 1.0f;
  const bool use_top_k = !greedy && top_k > 0 && top_k < v;
  const bool use_top_p = !greedy && top_p < 1.0f;
  const double t = greedy ? 1.0 : static_cast<double>(temperature);
  const double p_keep = static_cast<double>(top_p);

  const double inv_t = 1.0 / t;
  // rows in parallel, each part with its own scratch
  prl::ParallelFor(b, 4 * v, [&](int, int64_t begin, int64_t end) {
    float* proc = Scratch<float, 0>(v);
    double* z = Scratch<double, 1>(v);
    double* e = Scratch<double, 2>(v);
    std::vector<double> sorted;
    for (int64_t r = begin; r < end; ++r) {
      const float* x = xp + r * v;
      const bool banned = bp != nullptr && bp[r];
      const Scaled raw{x, inv_t};   // logits / temperature: the policy's distribution, whatever filters the draw
      if (!greedy && !penalize && !banned && !use_top_k && !use_top_p) {
        // nothing filters the row: the draw and the log-prob read the same distribution, made from the logits as
        // they are read (the numbers of the general path below, which would copy and widen the row first)
        const double m = MaxOf(raw, v);
        const double total = ExpShifted(raw, m, e, v);
        const int64_t token = InverseCdf(e, total, static_cast<double>(up[r]), v);
        tp[r] = token;
        lp[r] = static_cast<float>(raw.At(token) - (m + std::log(total)));
        continue;
      }
      std::memcpy(proc, x, sizeof(float) * v);
      if (penalize) {
        const float* s = sp + r * v;
        for (int64_t i = 0; i < v; ++i)
          if (s[i] > 0.0f) proc[i] = proc[i] > 0.0f ? proc[i] / penalty : proc[i] * penalty;
      }
      if (banned)
        for (int64_t k = 0; k < n_stop; ++k)
          if (stop[k] >= 0 && stop[k] < v) proc[stop[k]] = prl::kNegInf;
      int64_t token = 0;
      if (greedy) {
        float best = proc[0];
        for (int64_t i = 1; i < v; ++i)
          if (proc[i] > best) best = proc[i], token = i;
      } else {
        for (int64_t i = 0; i < v; ++i) z[i] = static_cast<double>(proc[i]) * inv_t;
        if (use_top_k) {
          sorted.assign(z, z + v);
          std::nth_element(sorted.begin(), sorted.begin() + (top_k - 1), sorted.end(), std::greater<double>());
          const double kth = sorted[top_k - 1];
          for (int64_t i = 0; i < v; ++i)
            if (z[i] < kth) z[i] = kDropped;
        }
        double m = MaxOf(Doubles{z}, v);
        double total = ExpShifted(Doubles{z}, m, e, v);
        if (use_top_p) {
          // values in descending order until the mass before a token reaches top_p; tokens tied with the last
          // kept one stay as well
          sorted.assign(z, z + v);
          int64_t done = 0, kept = 0, width = std::min<int64_t>(v, 64);
          double cum = 0.0;
          bool stopped = false;
          while (!stopped) {
            std::partial_sort(sorted.begin() + done, sorted.begin() + width, sorted.end(), std::greater<double>());
            for (int64_t j = done; j < width; ++j) {
              const double pj = prl::ExpD(sorted[j] - m) / total;
              cum += pj;
              if (cum - pj < p_keep) {
                kept = j + 1;
              } else {
                stopped = true;
                break;
              }
            }
            done = width;
            if (width == v) break;
            width = std::min<int64_t>(v, width * 8);
          }
          const double cut = sorted[kept - 1];
          for (int64_t i = 0; i < v; ++i)
            if (z[i] < cut) z[i] = kDropped;
          m = MaxOf(Doubles{z}, v);
          total = ExpShifted(Doubles{z}, m, e, v);
        }
        token = InverseCdf(e, total, static_cast<double>(up[r]), v);
      }
      tp[r] = token;
      // the log-prob from the raw logits (the draw's e is reused as scratch: the token is drawn)
      const double m = MaxOf(raw, v);
      const double total = ExpShifted(raw, m, e, v);
      lp[r] = static_cast<float>(raw.At(token) - (m + std::log(total)));
    }
  });
}

#ifndef PRL_NO_PADDLE
#ifdef PRL_WITH_CUDA
std::vector<paddle::Tensor> SampleCUDA(const paddle::Tensor& logits, const paddle::optional<paddle::Tensor>& seen,
                                       const paddle::optional<paddle::Tensor>& uniforms,
                                       const paddle::optional<paddle::Tensor>& ban, const paddle::Tensor& stop_ids,
                                       float temperature, int top_k, float top_p, float penalty);
#endif

std::vector<paddle::Tensor> Sample(const paddle::Tensor& logits, const paddle::optional<paddle::Tensor>& seen,
                                   const paddle::optional<paddle::Tensor>& uniforms,
                                   const paddle::optional<paddle::Tensor>& ban, const paddle::Tensor& stop_ids,
                                   float temperature, int top_k, float top_p, float penalty) {
#ifdef PRL_WITH_CUDA
  if (logits.is_gpu()) return SampleCUDA(logits, seen, uniforms, ban, stop_ids, temperature, top_k, top_p, penalty);
#endif
  const char* op = "prl_sample";
  prl::CheckCpuFloat(logits, op, "logits");
  PD_CHECK(logits.shape().size() == 2, op, ": logits must be [B, V]");
  const int64_t b = logits.shape()[0], v = logits.shape()[1];
  const bool greedy = temperature <= 0.0f;
  PD_CHECK(greedy || uniforms, op, ": sampling needs uniforms");
  if (uniforms) PD_CHECK(uniforms->numel() == b, op, ": uniforms must be [B]");
  if (seen) PD_CHECK(seen->numel() == b * v, op, ": seen must be [B, V]");
  if (ban) PD_CHECK(ban->numel() == b && ban->dtype() == paddle::DataType::BOOL, op, ": ban must be bool [B]");
  PD_CHECK(stop_ids.dtype() == paddle::DataType::INT64, op, ": stop_ids must be int64");
  auto tokens = paddle::empty({b}, paddle::DataType::INT64, logits.place());
  auto logprob = paddle::empty({b}, paddle::DataType::FLOAT32, logits.place());
  const float* xp = logits.data<float>();
  const float* sp = seen ? seen->data<float>() : nullptr;
  const float* up = uniforms ? uniforms->data<float>() : nullptr;
  const bool* bp = ban ? ban->data<bool>() : nullptr;
  const int64_t* stop = stop_ids.data<int64_t>();
  const int64_t n_stop = stop_ids.numel();
  int64_t* tp = tokens.data<int64_t>();
  float* lp = logprob.data<float>();
  prl_cpu::Sample(xp, sp, up, bp, stop, n_stop, tp, lp, b, v, temperature, top_k, top_p, penalty);
  return {tokens, logprob};
}

std::vector<std::vector<int64_t>> SampleInferShape(const std::vector<int64_t>& logits,
                                                   const paddle::optional<std::vector<int64_t>>& seen,
                                                   const paddle::optional<std::vector<int64_t>>& uniforms,
                                                   const paddle::optional<std::vector<int64_t>>& ban,
                                                   const std::vector<int64_t>& stop_ids, float temperature, int top_k,
                                                   float top_p, float penalty) {
  return {{logits[0]}, {logits[0]}};
}

std::vector<paddle::DataType> SampleInferDtype(paddle::DataType logits, const paddle::optional<paddle::DataType>& seen,
                                               const paddle::optional<paddle::DataType>& uniforms,
                                               const paddle::optional<paddle::DataType>& ban,
                                               paddle::DataType stop_ids) {
  return {paddle::DataType::INT64, paddle::DataType::FLOAT32};
}

PD_BUILD_OP(prl_sample)
    .Inputs({"Logits", paddle::Optional("Seen"), paddle::Optional("Uniforms"), paddle::Optional("Ban"), "StopIds"})
    .Outputs({"Tokens", "Logprob"})
    .Attrs({"temperature: float", "top_k: int", "top_p: float", "penalty: float"})
    .SetKernelFn(PD_KERNEL(Sample))
    .SetInferShapeFn(PD_INFER_SHAPE(SampleInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SampleInferDtype));
#endif  // PRL_NO_PADDLE
