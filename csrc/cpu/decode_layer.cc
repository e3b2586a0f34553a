// One decoder layer of a rollout decode step (one token per row) in one op, for the dense pre-norm layers of the
// Llama / Qwen2 / Qwen3 families (SwiGLU MLP, no sandwich norms):
//   h = RMSNorm(x); qkv = h Wqkv (+ bias); q = rotary(q/k-normed q), k and v written into the caches at `slot`;
//   a = attention of q over slots start[b] .. length - 1; x1 = x + (a Wo (+ bias));
//   out = x1 + SwiGLU(RMSNorm(x1) Wgate_up) Wdown
// models/decoder.py runs the same layer as ten kernel calls (ops/decode_layer.py decode_layer_reference); here
// the same launchers run back to back in the same order on the same numbers, so the output, q and the caches are
// the same bits, with one dispatch instead of ten (~16-35 us each alone, 50-300 us in a decode step: most of a
// small model's step). The weights are the rollout's packed copies: float32 panels, or a low-precision pack (bfloat16,
// weight_only_int8 / int4) with its scales. The row-wise steps (norms, bias and residual adds, rotary, SwiGLU)
// split their rows over the threads from 16K elements on; a row's numbers never depend on the split. `shared` [B, 2]
// (optional): row b's slots start[b] .. shared[b][1] - 1 hold the same keys and values as row shared[b][0]'s (a
// prompt's samples) and the attention reads them there (cpu/kernels.h DecodeAttention: the same bits).
#ifndef PRL_NO_PADDLE
#include "../prl_common.h"
#include "../prl_lowp.h"
#include "kernels.h"

namespace {

// fn(begin, end) over rows [0, rows) of `width` elements each, in parallel parts from 16K elements on
template <typename Fn>
void OverRowRanges(int64_t rows, int64_t width, Fn fn) {
  prl::ParallelFor(rows, width * 16, [&](int, int64_t begin, int64_t end) { fn(begin, end); });
}

// out [rows, n] = x [rows, k_dim] W, W packed as the rollout packs it (ops/linear.py): float32 [P, K, 32], or a
// low-precision pack named by its dtype with its scales
void Product(const float* x, int64_t rows, int64_t k_dim, const paddle::Tensor& w,
             const paddle::optional<paddle::Tensor>& scales, int64_t n, bool bf16_act, float* out, const char* name) {
  const char* op = "prl_decode_layer";
  PD_CHECK(w.is_cpu(), op, ": ", name, " must be a CPU tensor");
  const int64_t panels = prl::LowpPanels(n);
  if (w.dtype() == paddle::DataType::FLOAT32) {
    const auto& s = w.shape();
    PD_CHECK(s.size() == 3 && s[0] == panels && s[1] == k_dim && s[2] == prl::kLowpPanel, op, ": ", name,
             " must be float32 panels [", panels, ", ", k_dim, ", 32]");
    prl_cpu::PackedLinear(x, w.data<float>(), out, rows, k_dim, n);
    return;
  }
  const prl::LowpFormat format = FormatOf(w, op);   // linear.cc's: the format its dtype names
  const int64_t bytes = w.numel() * (format == prl::LowpFormat::kBF16 ? 2 : 1);
  PD_CHECK(format != prl::LowpFormat::kBF16 || bf16_act, op, ": ", name,
           ": bfloat16 weights multiply bfloat16 activations (bf16_act)");
  PD_CHECK(bytes == prl::LowpPackedBytes(format, k_dim, n), op, ": ", name, " holds ", bytes, " bytes; a ",
           prl::LowpFormatName(format), " pack of [", k_dim, ", ", n, "] holds ", prl::LowpPackedBytes(format, k_dim, n));
  PD_CHECK(scales && scales->is_cpu() && scales->dtype() == paddle::DataType::FLOAT32 &&
               scales->numel() == prl::LowpScaleCount(format, k_dim, n),
           op, ": ", name, ": a ", prl::LowpFormatName(format), " pack needs its ",
           prl::LowpScaleCount(format, k_dim, n), " float32 scales on the CPU");
  prl_cpu::PackedLinearLowp(x, w.data(), scales->data<float>(), format, out, rows, k_dim, n, bf16_act);
}

void CheckVector(const paddle::optional<paddle::Tensor>& t, int64_t size, const char* name) {
  if (!t) return;
  prl::CheckCpuFloat(*t, "prl_decode_layer", name);
  PD_CHECK(t->numel() == size, "prl_decode_layer: ", name, " must have ", size, " elements, not ", t->numel());
}

// rows [begin, end) of y [rows, n] += v (a bias [n], or another [rows, n] array with `per_row`)
void AddRows(float* y, const float* v, int64_t n, bool per_row, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) {
    float* row = y + r * n;
    const float* add = per_row ? v + r * n : v;
    for (int64_t j = 0; j < n; ++j) row[j] += add[j];
  }
}

}  // namespace

std::vector<paddle::Tensor> DecodeLayer(
    const paddle::Tensor& x, const paddle::Tensor& in_norm, const paddle::Tensor& qkv_w,
    const paddle::optional<paddle::Tensor>& qkv_scales, const paddle::optional<paddle::Tensor>& qkv_bias,
    const paddle::Tensor& positions, const paddle::Tensor& inv_freq, paddle::Tensor& cache_k, paddle::Tensor& cache_v,
    const paddle::Tensor& start, const paddle::optional<paddle::Tensor>& q_norm,
    const paddle::optional<paddle::Tensor>& k_norm, const paddle::Tensor& o_w,
    const paddle::optional<paddle::Tensor>& o_scales, const paddle::optional<paddle::Tensor>& o_bias,
    const paddle::Tensor& post_norm, const paddle::Tensor& gate_up_w,
    const paddle::optional<paddle::Tensor>& gate_up_scales, const paddle::Tensor& down_w,
    const paddle::optional<paddle::Tensor>& down_scales, const paddle::optional<paddle::Tensor>& shared,
    int num_heads, int num_kv_heads, int64_t intermediate, int64_t slot, int64_t length, float eps, float qk_eps,
    float scale, bool bf16_act) {
  const char* op = "prl_decode_layer";
  prl::CheckCpuFloat(x, op, "x");
  prl::CheckCpuFloat(inv_freq, op, "inv_freq");
  PD_CHECK(positions.dtype() == paddle::DataType::INT64 && start.dtype() == paddle::DataType::INT64, op,
           ": positions and start must be int64");
  const auto& xs = x.shape();
  const auto& cs = cache_k.shape();
  PD_CHECK(xs.size() == 3 && xs[1] == 1 && cs.size() == 4, op, ": x [B, 1, hidden], caches [B, KV, C, D]");
  const int64_t rows = xs[0], hidden = xs[2], d = cs[3], cap = cs[2];
  const int64_t q_width = num_heads * d, qkv_n = (num_heads + 2 * num_kv_heads) * d;
  PD_CHECK(num_kv_heads >= 1 && num_heads % num_kv_heads == 0 && d % 2 == 0, op, ": ", num_heads, " heads over ",
           num_kv_heads, " kv heads of even size ", d);
  PD_CHECK(cs[0] == rows && cs[1] == num_kv_heads && cache_v.shape() == cs, op, ": caches must be [", rows, ", ",
           num_kv_heads, ", C, ", d, "]");
  PD_CHECK(slot >= 0 && slot < cap && length == slot + 1, op, ": slot ", slot, " and length ", length,
           " (slot + 1) inside the cache (", cap, ")");
  PD_CHECK(positions.numel() == rows && start.numel() == rows, op, ": positions and start must be [B]");
  PD_CHECK(inv_freq.numel() == d / 2, op, ": inv_freq must have head_dim / 2 elements");
  CheckVector(in_norm, hidden, "in_norm");
  CheckVector(post_norm, hidden, "post_norm");
  CheckVector(qkv_bias, qkv_n, "qkv_bias");
  CheckVector(o_bias, hidden, "o_bias");
  CheckVector(q_norm, d, "q_norm");
  CheckVector(k_norm, d, "k_norm");
  PD_CHECK(q_norm.is_initialized() == k_norm.is_initialized(), op, ": q_norm and k_norm come together");
  if (shared) {
    PD_CHECK(shared->is_cpu() && shared->dtype() == paddle::DataType::INT64 && shared->numel() == 2 * rows, op,
             ": shared must be int64 [B, 2] on the CPU");
    const int64_t* sh = shared->data<int64_t>();
    for (int64_t b = 0; b < rows; ++b) PD_CHECK(sh[2 * b] >= 0 && sh[2 * b] < rows, op, ": shared row out of range");
  }
  const prl::KvDtype kv_dtype = prl::CpuCacheDtype(cache_k, cache_v, op);
  const int64_t kv_bytes = kv_dtype == prl::KvDtype::kFloat32 ? 4 : 2;

  // scratch for the layer's intermediates, kept by the calling thread between calls (no page faults per call)
  thread_local std::vector<float> scratch;
  const int64_t need = rows * (hidden + 1 + qkv_n + 2 * q_width + hidden + 3 * intermediate);
  if (static_cast<int64_t>(scratch.size()) < need) scratch.resize(need);
  float* h = scratch.data();           // [rows, hidden]: a norm's output
  float* rstd = h + rows * hidden;     // [rows]
  float* qkv = rstd + rows;            // [rows, qkv_n]
  float* q = qkv + rows * qkv_n;       // [rows, heads * d]
  float* attn = q + rows * q_width;    // [rows, heads * d]
  float* x1 = attn + rows * q_width;   // [rows, hidden]: the residual stream after attention
  float* gu = x1 + rows * hidden;      // [rows, 2 intermediate]
  float* act = gu + rows * 2 * intermediate;  // [rows, intermediate]
  const float* xp = x.data<float>();
  const int64_t* pos = positions.data<int64_t>();
  char* kp = static_cast<char*>(cache_k.data());
  char* vp = static_cast<char*>(cache_v.data());
  const int64_t cache_row = num_kv_heads * cap * d * kv_bytes;   // bytes of one row's cache

  // attention block
  OverRowRanges(rows, hidden, [&](int64_t b, int64_t e) {
    prl_cpu::RmsNormForward(xp + b * hidden, in_norm.data<float>(), h + b * hidden, rstd + b, e - b, hidden, eps);
  });
  Product(h, rows, hidden, qkv_w, qkv_scales, qkv_n, bf16_act, qkv, "qkv");
  if (qkv_bias) {
    OverRowRanges(rows, qkv_n, [&](int64_t b, int64_t e) { AddRows(qkv, qkv_bias->data<float>(), qkv_n, false, b, e); });
  }
  OverRowRanges(rows, qkv_n * 4, [&](int64_t b, int64_t e) {
    prl_cpu::RotaryQkvCache(qkv + b * qkv_n, pos + b, inv_freq.data<float>(), q + b * q_width, kp + b * cache_row,
                            vp + b * cache_row, kv_dtype, q_norm ? q_norm->data<float>() : nullptr,
                            k_norm ? k_norm->data<float>() : nullptr, e - b, 1, num_heads, num_kv_heads, d, cap, slot,
                            qk_eps);
  });
  prl_cpu::DecodeAttention(q, kp, vp, kv_dtype, start.data<int64_t>(), attn, rows, num_heads, num_kv_heads, cap, d,
                           length, scale, shared ? shared->data<int64_t>() : nullptr);
  Product(attn, rows, q_width, o_w, o_scales, hidden, bf16_act, x1, "o");
  OverRowRanges(rows, hidden, [&](int64_t b, int64_t e) {
    if (o_bias) AddRows(x1, o_bias->data<float>(), hidden, false, b, e);
    AddRows(x1, xp, hidden, true, b, e);   // the residual add: (a Wo) + x, as Paddle's add
  });

  // MLP block
  OverRowRanges(rows, hidden, [&](int64_t b, int64_t e) {
    prl_cpu::RmsNormForward(x1 + b * hidden, post_norm.data<float>(), h + b * hidden, rstd + b, e - b, hidden, eps);
  });
  Product(h, rows, hidden, gate_up_w, gate_up_scales, 2 * intermediate, bf16_act, gu, "gate_up");
  OverRowRanges(rows, 2 * intermediate, [&](int64_t b, int64_t e) {
    prl_cpu::SwigluForward(gu + b * 2 * intermediate, act + b * intermediate, e - b, intermediate);
  });
  auto out = paddle::empty({rows, 1, hidden}, x.dtype(), x.place());
  float* o = out.data<float>();
  Product(act, rows, intermediate, down_w, down_scales, hidden, bf16_act, o, "down");
  OverRowRanges(rows, hidden, [&](int64_t b, int64_t e) { AddRows(o, x1, hidden, true, b, e); });
  return {out};
}

std::vector<std::vector<int64_t>> DecodeLayerInferShape(
    const std::vector<int64_t>& x, const std::vector<int64_t>& in_norm, const std::vector<int64_t>& qkv_w,
    const paddle::optional<std::vector<int64_t>>& qkv_scales, const paddle::optional<std::vector<int64_t>>& qkv_bias,
    const std::vector<int64_t>& positions, const std::vector<int64_t>& inv_freq, const std::vector<int64_t>& cache_k,
    const std::vector<int64_t>& cache_v, const std::vector<int64_t>& start,
    const paddle::optional<std::vector<int64_t>>& q_norm, const paddle::optional<std::vector<int64_t>>& k_norm,
    const std::vector<int64_t>& o_w, const paddle::optional<std::vector<int64_t>>& o_scales,
    const paddle::optional<std::vector<int64_t>>& o_bias, const std::vector<int64_t>& post_norm,
    const std::vector<int64_t>& gate_up_w, const paddle::optional<std::vector<int64_t>>& gate_up_scales,
    const std::vector<int64_t>& down_w, const paddle::optional<std::vector<int64_t>>& down_scales,
    const paddle::optional<std::vector<int64_t>>& shared, int num_heads, int num_kv_heads, int64_t intermediate,
    int64_t slot, int64_t length, float eps, float qk_eps, float scale, bool bf16_act) {
  return {x, cache_k, cache_v};
}

std::vector<paddle::DataType> DecodeLayerInferDtype(
    paddle::DataType x, paddle::DataType in_norm, paddle::DataType qkv_w,
    const paddle::optional<paddle::DataType>& qkv_scales, const paddle::optional<paddle::DataType>& qkv_bias,
    paddle::DataType positions, paddle::DataType inv_freq, paddle::DataType cache_k, paddle::DataType cache_v,
    paddle::DataType start, const paddle::optional<paddle::DataType>& q_norm,
    const paddle::optional<paddle::DataType>& k_norm, paddle::DataType o_w,
    const paddle::optional<paddle::DataType>& o_scales, const paddle::optional<paddle::DataType>& o_bias,
    paddle::DataType post_norm, paddle::DataType gate_up_w, const paddle::optional<paddle::DataType>& gate_up_scales,
    paddle::DataType down_w, const paddle::optional<paddle::DataType>& down_scales,
    const paddle::optional<paddle::DataType>& shared) {
  return {x, cache_k, cache_v};
}

PD_BUILD_OP(prl_decode_layer)
    .Inputs({"X", "InNorm", "QkvW", paddle::Optional("QkvScales"), paddle::Optional("QkvBias"), "Positions",
             "InvFreq", "CacheK", "CacheV", "Start", paddle::Optional("QNorm"), paddle::Optional("KNorm"), "OW",
             paddle::Optional("OScales"), paddle::Optional("OBias"), "PostNorm", "GateUpW",
             paddle::Optional("GateUpScales"), "DownW", paddle::Optional("DownScales"), paddle::Optional("Shared")})
    .Outputs({"Out", "CacheKOut", "CacheVOut"})
    .Attrs({"num_heads: int", "num_kv_heads: int", "intermediate: int64_t", "slot: int64_t", "length: int64_t",
            "eps: float", "qk_eps: float", "scale: float", "bf16_act: bool"})
    .SetInplaceMap({{"CacheK", "CacheKOut"}, {"CacheV", "CacheVOut"}})
    .SetKernelFn(PD_KERNEL(DecodeLayer))
    .SetInferShapeFn(PD_INFER_SHAPE(DecodeLayerInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(DecodeLayerInferDtype));
#endif  // PRL_NO_PADDLE
