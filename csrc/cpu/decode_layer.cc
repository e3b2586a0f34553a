// One decoder layer of a rollout decode step (one token per row) in one op, for the dense pre-norm layers of the
// Llama / Qwen2 / Qwen3 families (SwiGLU MLP, no sandwich norms):
//   h = RMSNorm(x); qkv = h Wqkv (+ bias); q = rotary(q/k-normed q), k and v written into the caches at `slot`;
//   a = attention of q over slots start[b] .. length - 1; x1 = x + (a Wo (+ bias));
//   out = x1 + SwiGLU(RMSNorm(x1) Wgate_up) Wdown
// models/decoder.py runs the same layer as ten kernel calls (ops/decode_layer.py decode_layer_reference); here
// the same launchers run back to back in the same order on the same numbers, so the output, q and the caches are
// the same bits, with one dispatch instead of ten (~16-35 us each alone, 50-300 us in a decode step: most of a
// small model's step). The weights are the rollout's packed copies: float32 panels, or a low-precision pack (bfloat16,
// weight_only_int8 / int4) with its scales. The threads take either each a share of the rows through the whole layer,
// or each step in turn (SplitRows says which); a row's numbers never depend on the split. `shared` [B, 2]
// (optional): row b's slots start[b] .. shared[b][1] - 1 hold the same keys and values as row shared[b][0]'s (a
// prompt's samples) and the attention reads them there (cpu/kernels.h DecodeAttention: the same bits).
#ifndef PRL_NO_PADDLE
#include "../prl_common.h"
#include "../prl_lowp.h"
#include "kernels.h"

namespace prl_cpu {
// attention.cc: DecodeAttention's rows [row_begin, row_end) in the calling thread
void DecodeAttentionRows(const float* q, const void* cache_k, const void* cache_v, KvDtype cache, const int64_t* start,
                         float* out, int64_t row_begin, int64_t row_end, int64_t heads, int64_t kv, int64_t cap,
                         int64_t d, int64_t length, float scale, const int64_t* shared);
}  // namespace prl_cpu

namespace {

// fn(first, last) over rows [begin, end) of `width` elements each, in parallel parts from 16K elements on (in turn
// inside a parallel region)
template <typename Fn>
void OverRowRanges(int64_t begin, int64_t end, int64_t width, Fn fn) {
  prl::ParallelFor(end - begin, width * 16, [&](int, int64_t b, int64_t e) { fn(begin + b, begin + e); });
}

// How the layer's rows meet the threads. `rows`: each thread runs the whole layer on its own rows, so no thread
// reads what another wrote (a row's keys and values are its own; the prompt slots it shares were written by the
// prefill) and none waits for another until the end, but every thread reads all the weights. `phases`: each step
// splits over the threads alone (the products by column panels, the row-wise steps by rows), so the weights are read
// once, but each phase's outputs move between the cores for the next and the threads meet after every step. The
// default takes the split that moves fewer bytes: rows where the extra reads of the weights (float32 panels:
// `weight_bytes`, once per further thread) come to no more than the activations a phased layer passes on
// (`row_bytes` a row). On the EPYC Zen 3, 2 threads, a layer's call in the quickstart's rollout (236 rows, 0.7 MB of
// weights) took 0.86-0.90x as long with rows; W3's (64 rows, 14 MB) 1.01-1.11x as long, so it stays phased
// (docs/kernels.md). PADDLE_RL_DECODE_LAYER_SPLIT=rows or phases forces one (read at each call); low-precision packs
// always run phased. Both give the same bits: a row's numbers never depend on the split.
bool SplitRows(int64_t rows, int64_t weight_bytes, int64_t row_bytes, bool f32) {
  const char* env = std::getenv("PADDLE_RL_DECODE_LAYER_SPLIT");
  const int threads = prl::NumThreads();
  if (!f32 || threads < 2 || rows < 2) return false;
  if (env && *env) {
    if (std::strcmp(env, "rows") == 0) return true;
    if (std::strcmp(env, "phases") == 0) return false;
  }
  return (threads - 1) * weight_bytes <= rows * row_bytes;
}

// Whether W (packed as the rollout packs it, ops/linear.py: float32 [P, K, 32], or a low-precision pack named by
// its dtype with its scales) is one x [rows, k_dim] W -> [rows, n] can take; an error names it otherwise
void CheckProduct(int64_t k_dim, const paddle::Tensor& w, const paddle::optional<paddle::Tensor>& scales, int64_t n,
                  bool bf16_act, const char* name) {
  const char* op = "prl_decode_layer";
  PD_CHECK(w.is_cpu(), op, ": ", name, " must be a CPU tensor");
  const int64_t panels = prl::LowpPanels(n);
  if (w.dtype() == paddle::DataType::FLOAT32) {
    const auto& s = w.shape();
    PD_CHECK(s.size() == 3 && s[0] == panels && s[1] == k_dim && s[2] == prl::kLowpPanel, op, ": ", name,
             " must be float32 panels [", panels, ", ", k_dim, ", 32]");
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
}

// A product's weight as CheckProduct took it: float32 panels, or a low-precision pack and its scales
struct LayerWeight {
  const void* data;
  const float* scales;
  bool f32;
  prl::LowpFormat format;
};

LayerWeight Resolve(const paddle::Tensor& w, const paddle::optional<paddle::Tensor>& scales) {
  if (w.dtype() == paddle::DataType::FLOAT32) return {w.data<float>(), nullptr, true, prl::LowpFormat::kBF16};
  return {w.data(), scales->data<float>(), false, FormatOf(w, "prl_decode_layer")};
}

// out [rows, n] = x [rows, k_dim] W
void Product(const float* x, int64_t rows, int64_t k_dim, const LayerWeight& w, int64_t n, bool bf16_act, float* out) {
  if (w.f32) {
    prl_cpu::PackedLinear(x, static_cast<const float*>(w.data), out, rows, k_dim, n);
    return;
  }
  prl_cpu::PackedLinearLowp(x, w.data, w.scales, w.format, out, rows, k_dim, n, bf16_act);
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

  CheckProduct(hidden, qkv_w, qkv_scales, qkv_n, bf16_act, "qkv");
  CheckProduct(q_width, o_w, o_scales, hidden, bf16_act, "o");
  CheckProduct(hidden, gate_up_w, gate_up_scales, 2 * intermediate, bf16_act, "gate_up");
  CheckProduct(intermediate, down_w, down_scales, hidden, bf16_act, "down");
  const LayerWeight wqkv = Resolve(qkv_w, qkv_scales), wo = Resolve(o_w, o_scales);
  const LayerWeight wgu = Resolve(gate_up_w, gate_up_scales), wdown = Resolve(down_w, down_scales);

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
  const float* in_w = in_norm.data<float>();
  const float* post_w = post_norm.data<float>();
  const float* qkv_b = qkv_bias ? qkv_bias->data<float>() : nullptr;
  const float* o_b = o_bias ? o_bias->data<float>() : nullptr;
  const float* qn = q_norm ? q_norm->data<float>() : nullptr;
  const float* kn = k_norm ? k_norm->data<float>() : nullptr;
  const int64_t* st = start.data<int64_t>();
  const int64_t* sh = shared ? shared->data<int64_t>() : nullptr;
  auto out = paddle::empty({rows, 1, hidden}, x.dtype(), x.place());
  float* o = out.data<float>();

  // The phases of rows [b, e): each phase's launcher splits its rows or columns over the threads, unless the caller
  // already runs in a parallel region (then it runs its parts in this thread, prl::ParallelFor).
  auto attention_in = [&](int64_t b, int64_t e) {   // norm, q/k/v, bias, rotary and the cache write
    OverRowRanges(b, e, hidden, [&](int64_t i, int64_t j) {
      prl_cpu::RmsNormForward(xp + i * hidden, in_w, h + i * hidden, rstd + i, j - i, hidden, eps);
    });
    Product(h + b * hidden, e - b, hidden, wqkv, qkv_n, bf16_act, qkv + b * qkv_n);
    if (qkv_b) OverRowRanges(b, e, qkv_n, [&](int64_t i, int64_t j) { AddRows(qkv, qkv_b, qkv_n, false, i, j); });
    OverRowRanges(b, e, qkv_n * 4, [&](int64_t i, int64_t j) {
      prl_cpu::RotaryQkvCache(qkv + i * qkv_n, pos + i, inv_freq.data<float>(), q + i * q_width, kp + i * cache_row,
                              vp + i * cache_row, kv_dtype, qn, kn, j - i, 1, num_heads, num_kv_heads, d, cap, slot,
                              qk_eps);
    });
  };
  auto attention_out = [&](int64_t b, int64_t e) {   // the output product, its bias and the residual add
    Product(attn + b * q_width, e - b, q_width, wo, hidden, bf16_act, x1 + b * hidden);
    OverRowRanges(b, e, hidden, [&](int64_t i, int64_t j) {
      if (o_b) AddRows(x1, o_b, hidden, false, i, j);
      AddRows(x1, xp, hidden, true, i, j);   // the residual add: (a Wo) + x, as Paddle's add
    });
  };
  auto mlp = [&](int64_t b, int64_t e) {
    OverRowRanges(b, e, hidden, [&](int64_t i, int64_t j) {
      prl_cpu::RmsNormForward(x1 + i * hidden, post_w, h + i * hidden, rstd + i, j - i, hidden, eps);
    });
    Product(h + b * hidden, e - b, hidden, wgu, 2 * intermediate, bf16_act, gu + b * 2 * intermediate);
    OverRowRanges(b, e, 2 * intermediate, [&](int64_t i, int64_t j) {
      prl_cpu::SwigluForward(gu + i * 2 * intermediate, act + i * intermediate, j - i, intermediate);
    });
    Product(act + b * intermediate, e - b, intermediate, wdown, hidden, bf16_act, o + b * hidden);
    OverRowRanges(b, e, hidden, [&](int64_t i, int64_t j) { AddRows(o, x1, hidden, true, i, j); });
  };
  const int64_t panel_rows = hidden * (prl::LowpPanels(qkv_n) + prl::LowpPanels(2 * intermediate)) +
                             (q_width + intermediate) * prl::LowpPanels(hidden);
  const int64_t weight_bytes = 4 * prl::kLowpPanel * panel_rows;   // the four products' float32 panels
  const int64_t row_bytes = 4 * (3 * hidden + qkv_n + 2 * q_width + 3 * intermediate);   // what a row's steps write
  if (SplitRows(rows, weight_bytes, row_bytes, wqkv.f32 && wo.f32 && wgu.f32 && wdown.f32)) {
    prl::ParallelFor(rows, int64_t{1} << 18, [&](int, int64_t b, int64_t e) {   // a part for each thread
      attention_in(b, e);
      prl_cpu::DecodeAttentionRows(q, kp, vp, kv_dtype, st, attn, b, e, num_heads, num_kv_heads, cap, d, length, scale,
                                   sh);
      attention_out(b, e);
      mlp(b, e);
    });
    return {out};
  }
  attention_in(0, rows);
  prl_cpu::DecodeAttention(q, kp, vp, kv_dtype, st, attn, rows, num_heads, num_kv_heads, cap, d, length, scale, sh);
  attention_out(0, rows);
  mlp(0, rows);
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
