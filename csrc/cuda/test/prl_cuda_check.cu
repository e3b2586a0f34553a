// Every CUDA kernel of csrc/cuda against the CPU kernel of csrc/cpu on the same random inputs, without Paddle:
// the GPU side through the launchers of csrc/cuda/launch.h, the CPU side through those of csrc/cpu/kernels.h (the
// CPU kernels' own code, compiled by the host compiler with -DPRL_NO_PADDLE). Built and run by
// `python tools/cuda_check.py`.
//
//   prl_cuda_check [--seed N]
//
// Tolerances are those of tests/test_ops.py: float32 results within 1e-5 of the output's scale (max(1, max |CPU|)),
// log-probs and entropies 2e-5, LM-head log-prob gradients 1e-4; sampled tokens, copies, the step bookkeeping and
// 16-bit value writes exactly equal; 16-bit key writes (rotated in float32 on both sides, then rounded) at most one
// 16-bit step apart. The low-precision packed products (the CPU's pack read by both, the float32 sums in another
// order on the GPU): each element within its own rounding bound, derived from K (CheckPackedLinearLowp). One line
// per kernel: its name, the GPU, the largest absolute error, the largest error relative to the output's scale, the
// tolerance, PASS or FAIL. Exit status 0 when all pass, 1 when one fails, 77 when no CUDA device can be used
// (nothing was compared).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "../../cpu/kernels.h"
#include "../launch.h"

namespace {

using prl::KvDtype;
using prl::LowpFormat;

#define CHECK_CUDA(call)                                                                                        \
  do {                                                                                                          \
    const cudaError_t err_ = (call);                                                                            \
    if (err_ != cudaSuccess) {                                                                                  \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_));      \
      std::exit(1);                                                                                             \
    }                                                                                                           \
  } while (0)

std::mt19937_64 rng;
std::string gpu_name;

// device copy of a host vector, and back
template <typename T>
struct Device {
  T* ptr = nullptr;
  size_t n = 0;
  explicit Device(const std::vector<T>& host) : n(host.size()) {
    CHECK_CUDA(cudaMalloc(&ptr, std::max<size_t>(1, n) * sizeof(T)));
    if (n) CHECK_CUDA(cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
  }
  explicit Device(size_t count) : n(count) {
    CHECK_CUDA(cudaMalloc(&ptr, std::max<size_t>(1, n) * sizeof(T)));
    CHECK_CUDA(cudaMemset(ptr, 0xff, std::max<size_t>(1, n) * sizeof(T)));  // garbage, not zeros
  }
  Device(const Device&) = delete;
  ~Device() { cudaFree(ptr); }
  std::vector<T> Host() const {
    std::vector<T> out(n);
    if (n) CHECK_CUDA(cudaMemcpy(out.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }
};

void Launched(cudaError_t err, const char* what) {
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(err));
    std::exit(1);
  }
}

std::vector<float> Normal(size_t n, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> out(n);
  for (auto& x : out) x = dist(rng) * scale;
  return out;
}

std::vector<float> Uniform(size_t n) {
  std::uniform_real_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> out(n);
  for (auto& x : out) x = dist(rng);
  return out;
}

std::vector<int64_t> Integers(size_t n, int64_t lo, int64_t hi) {  // [lo, hi)
  std::uniform_int_distribution<int64_t> dist(lo, hi - 1);
  std::vector<int64_t> out(n);
  for (auto& x : out) x = dist(rng);
  return out;
}

// The worst result of one kernel over its cases.
struct Result {
  double abs = 0.0, rel = 0.0, tol = 0.0;
  bool ok = true;
  std::vector<std::string> failures;
};
std::map<std::string, Result> results;
std::vector<std::string> order;

Result& For(const std::string& kernel) {
  if (!results.count(kernel)) order.push_back(kernel);
  return results[kernel];
}

// |gpu - cpu| <= tol * max(1, max |cpu|) (tests/test_ops.py's `close`)
void Close(const std::string& kernel, const std::string& what, const std::vector<float>& gpu,
           const std::vector<float>& cpu, double tol) {
  Result& r = For(kernel);
  double scale = 1.0, err = 0.0;
  bool finite = gpu.size() == cpu.size();
  for (size_t i = 0; i < cpu.size() && finite; ++i) {
    scale = std::max(scale, std::fabs(static_cast<double>(cpu[i])));
    if (!std::isfinite(gpu[i]) && std::isfinite(cpu[i])) finite = false;
    err = std::max(err, std::fabs(static_cast<double>(gpu[i]) - cpu[i]));
  }
  const double rel = finite ? err / scale : INFINITY;
  r.abs = std::max(r.abs, finite ? err : INFINITY);
  r.rel = std::max(r.rel, rel);
  r.tol = std::max(r.tol, tol);
  if (!(rel <= tol)) {
    r.ok = false;
    char line[256];
    std::snprintf(line, sizeof(line), "%s: max abs error %.3g, %.3g of the scale %.3g > %g", what.c_str(), err, rel,
                  scale, tol);
    r.failures.push_back(line);
  }
}

// bit for bit
template <typename T>
void Equal(const std::string& kernel, const std::string& what, const std::vector<T>& gpu, const std::vector<T>& cpu) {
  Result& r = For(kernel);
  size_t bad = gpu.size() == cpu.size() ? 0 : std::max(gpu.size(), cpu.size()), first = 0;
  for (size_t i = 0; i < std::min(gpu.size(), cpu.size()); ++i)
    if (std::memcmp(&gpu[i], &cpu[i], sizeof(T)) != 0 && bad++ == 0) first = i;
  if (bad) {
    r.ok = false;
    r.abs = r.rel = INFINITY;
    char line[256];
    std::snprintf(line, sizeof(line), "%s: %zu of %zu elements differ (first at %zu)", what.c_str(), bad, cpu.size(),
                  first);
    r.failures.push_back(line);
  }
}

// ------------------------------------------------------------------------------------------------ 16-bit values

float HalfBits(uint16_t h) { return __half2float(__ushort_as_half(h)); }
float BFloatBits(uint16_t h) { return __bfloat162float(__ushort_as_bfloat16(h)); }

// random cache contents of dtype t, as raw bytes (the same bytes go to both sides)
std::vector<uint8_t> RandomCache(size_t n, KvDtype t, float scale) {
  const std::vector<float> x = Normal(n, scale);
  std::vector<uint8_t> out(n * prl::KvDtypeBytes(t));
  for (size_t i = 0; i < n; ++i) {
    if (t == KvDtype::kFloat32) {
      std::memcpy(out.data() + 4 * i, &x[i], 4);
    } else {
      const uint16_t h = t == KvDtype::kFloat16 ? __half_as_ushort(__float2half_rn(x[i]))
                                                : __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

std::vector<float> AsFloat(const std::vector<uint8_t>& bytes, KvDtype t) {
  const size_t n = bytes.size() / prl::KvDtypeBytes(t);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (t == KvDtype::kFloat32) {
      std::memcpy(&out[i], bytes.data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      out[i] = t == KvDtype::kFloat16 ? HalfBits(h) : BFloatBits(h);
    }
  }
  return out;
}

// ------------------------------------------------------------------------------------------------ the kernels

void CheckRmsNorm() {
  for (const auto& [n, d] : std::vector<std::pair<int64_t, int64_t>>{{21, 64}, {1, 256}, {5, 24}, {900, 320}}) {
    const auto x = Normal(n * d, 3.0f), w = Normal(d), g = Normal(n * d);
    std::vector<float> y(n * d), rstd(n), gx(n * d), gw(d);
    prl_cpu::RmsNormForward(x.data(), w.data(), y.data(), rstd.data(), n, d, 1e-6f);
    prl_cpu::RmsNormBackward(x.data(), w.data(), rstd.data(), g.data(), gx.data(), gw.data(), n, d);
    Device<float> dx(x), dw(w), dg(g), dy(n * d), dr(n), dgx(n * d), dgw(d);
    Launched(prl_cuda::RmsNormForward(dx.ptr, dw.ptr, dy.ptr, dr.ptr, n, d, 1e-6f, nullptr), "rms_norm");
    Launched(prl_cuda::RmsNormBackward(dx.ptr, dw.ptr, dr.ptr, dg.ptr, dgx.ptr, dgw.ptr, n, d, nullptr),
             "rms_norm_grad");
    const std::string shape = "[" + std::to_string(n) + ", " + std::to_string(d) + "]";
    Close("rms_norm", shape + " y", dy.Host(), y, 1e-5);
    Close("rms_norm", shape + " rstd", dr.Host(), rstd, 1e-5);
    Close("rms_norm_grad", shape + " dx", dgx.Host(), gx, 1e-5);
    Close("rms_norm_grad", shape + " dw", dgw.Host(), gw, 1e-5);
  }
}

void CheckSwiglu() {
  for (const auto& [n, f] : std::vector<std::pair<int64_t, int64_t>>{{3, 7}, {37, 688}, {64, 1536}}) {
    const auto x = Normal(n * 2 * f, 2.0f), g = Normal(n * f);
    std::vector<float> out(n * f), grad(n * 2 * f);
    prl_cpu::SwigluForward(x.data(), out.data(), n, f);
    prl_cpu::SwigluBackward(x.data(), g.data(), grad.data(), n, f);
    Device<float> dx(x), dg(g), dout(n * f), dgrad(n * 2 * f);
    Launched(prl_cuda::SwigluForward(dx.ptr, dout.ptr, n, f, nullptr), "swiglu");
    Launched(prl_cuda::SwigluBackward(dx.ptr, dg.ptr, dgrad.ptr, n, f, nullptr), "swiglu_grad");
    const std::string shape = "[" + std::to_string(n) + ", " + std::to_string(2 * f) + "]";
    Close("swiglu", shape, dout.Host(), out, 1e-5);
    Close("swiglu_grad", shape, dgrad.Host(), grad, 1e-5);
  }
}

std::vector<float> InvFreq(int64_t d) {
  std::vector<float> out(d / 2);
  for (int64_t i = 0; i < d / 2; ++i) out[i] = 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) / d);
  return out;
}

void CheckRotary() {
  struct Case { int64_t b, l, heads, d, tb; };
  for (const Case& c : {Case{2, 9, 4, 32, 2}, Case{1, 1, 2, 64, 1}, Case{3, 5, 2, 16, 1}, Case{4, 33, 8, 128, 4}}) {
    const auto inv = InvFreq(c.d);
    const auto pos = Integers(c.tb * c.l, 0, 4000);
    std::vector<float> cos(c.tb * c.l * c.d), sin(cos.size());
    for (int64_t r = 0; r < c.tb * c.l; ++r)
      for (int64_t i = 0; i < c.d; ++i) {
        const float angle = static_cast<float>(pos[r]) * inv[i % (c.d / 2)];
        cos[r * c.d + i] = std::cos(angle);
        sin[r * c.d + i] = std::sin(angle);
      }
    const auto x = Normal(c.b * c.l * c.heads * c.d);
    Device<float> dx(x), dc(cos), ds(sin), dout(x.size());
    for (bool inverse : {false, true}) {
      std::vector<float> out(x.size());
      prl_cpu::Rotary(x.data(), cos.data(), sin.data(), out.data(), c.b, c.l, c.heads, c.d, c.tb, inverse);
      Launched(prl_cuda::Rotary(dx.ptr, dc.ptr, ds.ptr, dout.ptr, c.b, c.l, c.heads, c.d, c.tb, inverse, nullptr),
               "rotary");
      Close(inverse ? "rotary_grad" : "rotary", "d " + std::to_string(c.d), dout.Host(), out, 1e-5);
    }
  }
}

void CheckRotaryQkvCache(KvDtype t) {
  const std::string kernel = std::string("rotary_qkv_cache[") + prl::KvDtypeName(t) + "]";
  struct Case { int64_t b, l, heads, kv, d, cap, slot, max_pos; bool norm; };
  for (const Case& c : {Case{4, 1, 4, 2, 32, 12, 7, 3000, false}, Case{2, 3, 4, 2, 32, 12, 5, 3000, true},
                        Case{3, 1, 6, 2, 64, 10, 4, 3000, false}, Case{5, 2, 14, 2, 64, 40, 30, 32768, true},
                        Case{2, 4, 8, 8, 128, 8, 0, 32768, false}}) {
    const int64_t width = (c.heads + 2 * c.kv) * c.d, cache_n = c.b * c.kv * c.cap * c.d;
    const auto qkv = Normal(c.b * c.l * width, 3.0f);
    const auto pos = Integers(c.b * c.l, 0, c.max_pos);
    const auto inv = InvFreq(c.d);
    const auto qn = Normal(c.d), kn = Normal(c.d);
    const auto k0 = RandomCache(cache_n, t, 1.0f), v0 = RandomCache(cache_n, t, 1.0f);
    std::vector<float> q(c.b * c.l * c.heads * c.d);
    std::vector<uint8_t> k = k0, v = v0;
    prl_cpu::RotaryQkvCache(qkv.data(), pos.data(), inv.data(), q.data(), k.data(), v.data(), t,
                            c.norm ? qn.data() : nullptr, c.norm ? kn.data() : nullptr, c.b, c.l,
                            static_cast<int>(c.heads), static_cast<int>(c.kv), c.d, c.cap, c.slot, 1e-6f);
    Device<float> dqkv(qkv), dinv(inv), dqn(qn), dkn(kn), dq(q.size());
    Device<int64_t> dpos(pos);
    Device<uint8_t> dk(k0), dv(v0);
    Launched(prl_cuda::RotaryQkvCache(dqkv.ptr, dpos.ptr, dinv.ptr, dq.ptr, dk.ptr, dv.ptr, t,
                                      c.norm ? dqn.ptr : nullptr, c.norm ? dkn.ptr : nullptr, c.b, c.l,
                                      static_cast<int>(c.heads), static_cast<int>(c.kv), c.d, c.cap, c.slot, 1e-6f,
                                      nullptr),
             kernel.c_str());
    const std::string what = "d " + std::to_string(c.d) + (c.norm ? ", q/k norm" : "") + ", positions < " +
                             std::to_string(c.max_pos);
    Close(kernel, what + ": q", dq.Host(), q, 1e-5);
    Equal(kernel, what + ": value cache", dv.Host(), v);  // a cast of the same float: the same bits
    const auto gk = AsFloat(dk.Host(), t), ck = AsFloat(k, t);
    if (t == KvDtype::kFloat32) {
      Close(kernel, what + ": key cache", gk, ck, 1e-5);
    } else {  // rotated in float32 by both (to an ulp or so), then rounded: at most one 16-bit step apart
      const double step = t == KvDtype::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
      std::vector<float> excess(ck.size(), 0.0f);
      for (size_t i = 0; i < ck.size(); ++i) {
        const double bound = step * std::max<double>(std::fabs(ck[i]), 1e-3);
        excess[i] = static_cast<float>(std::max(0.0, std::fabs(static_cast<double>(gk[i]) - ck[i]) - bound));
      }
      Close(kernel, what + ": key cache beyond one 16-bit step", excess, std::vector<float>(ck.size(), 0.0f), 0.0);
    }
  }
}

void CheckDecodeAttention(KvDtype t) {
  const std::string kernel = std::string("decode_attention[") + prl::KvDtypeName(t) + "]";
  struct Case { int64_t b, heads, kv, d, length, cap; };
  for (const Case& c : {Case{5, 4, 2, 32, 9, 20}, Case{1, 2, 2, 32, 1, 20}, Case{16, 4, 2, 32, 100, 103},
                        Case{3, 9, 3, 64, 37, 42}, Case{3, 8, 2, 128, 40, 45}, Case{3, 4, 1, 128, 600, 605},
                        Case{6, 12, 2, 12, 37, 45}, Case{6, 7, 1, 16, 37, 45}, Case{40, 9, 3, 64, 400, 410}}) {
    const size_t cache_n = c.b * c.kv * c.cap * c.d;
    const auto q = Normal(c.b * c.heads * c.d);
    const auto k = RandomCache(cache_n, t, 2.0f), v = RandomCache(cache_n, t, 2.0f);
    const auto start = Integers(c.b, 0, c.length);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    std::vector<float> out(q.size());
    prl_cpu::DecodeAttention(q.data(), k.data(), v.data(), t, start.data(), out.data(), c.b, c.heads, c.kv, c.cap,
                             c.d, c.length, scale);
    Device<float> dq(q), dout(q.size()), scores(prl_cuda::DecodeAttentionScratch(c.b, c.heads, c.cap));
    Device<uint8_t> dk(k), dv(v);
    Device<int64_t> ds(start);
    Launched(prl_cuda::DecodeAttention(dq.ptr, dk.ptr, dv.ptr, t, ds.ptr, scores.ptr, dout.ptr, c.b, c.heads, c.kv,
                                       c.cap, c.d, c.length, scale, nullptr),
             kernel.c_str());
    Close(kernel,
          std::to_string(c.b) + " rows, " + std::to_string(c.heads) + "/" + std::to_string(c.kv) + " heads, d " +
              std::to_string(c.d) + ", " + std::to_string(c.length) + " slots",
          dout.Host(), out, 1e-5);
  }
}

void CheckKvPlace(KvDtype t) {
  const std::string kernel = std::string("kv_place[") + prl::KvDtypeName(t) + "]";
  const int64_t es = prl::KvDtypeBytes(t);
  struct Case { int64_t rd, rs, heads, cd, cs, d, n, width; bool fan; int64_t offset; };
  // offset: elements the dst and src pointers are moved by (narrower copy units)
  for (const Case& c : {Case{5, 4, 2, 12, 9, 8, 3, 6, false, 0}, Case{6, 6, 3, 7, 7, 16, 6, 7, false, 0},
                        Case{8, 2, 2, 9, 5, 32, 8, 5, true, 0}, Case{3, 3, 1, 4, 20, 4, 1, 1, false, 0},
                        Case{24, 6, 4, 300, 260, 64, 24, 250, true, 0}, Case{5, 4, 2, 12, 9, 3, 3, 6, false, 1},
                        Case{4, 4, 2, 10, 10, 64, 4, 9, false, 1}}) {
    std::vector<int64_t> rows(c.n);
    if (c.fan) {
      std::fill(rows.begin(), rows.end(), Integers(1, 0, c.rs)[0]);
    } else {
      std::vector<int64_t> all(c.rs);
      for (int64_t i = 0; i < c.rs; ++i) all[i] = i;
      std::shuffle(all.begin(), all.end(), rng);
      std::copy(all.begin(), all.begin() + c.n, rows.begin());
    }
    const int64_t dst_row = Integers(1, 0, c.rd - c.n + 1)[0], src_start = Integers(1, 0, c.cs - c.width + 1)[0],
                  dst_start = Integers(1, 0, c.cd - c.width + 1)[0];
    const auto dst0 = RandomCache(c.offset + c.rd * c.heads * c.cd * c.d, t, 1.0f);
    const auto src = RandomCache(c.offset + c.rs * c.heads * c.cs * c.d, t, 1.0f);
    std::vector<uint8_t> dst = dst0;
    prl_cpu::KvPlace(dst.data() + c.offset * es, src.data() + c.offset * es, rows.data(), c.n, c.heads, c.d, es,
                     c.cd, c.cs, dst_row, src_start, dst_start, c.width);
    Device<uint8_t> ddst(dst0), dsrc(src);
    Device<int64_t> drows(rows);
    Launched(prl_cuda::KvPlace(ddst.ptr + c.offset * es, dsrc.ptr + c.offset * es, drows.ptr, c.n, c.heads, c.d, es,
                               c.cd, c.cs, c.rs, dst_row, src_start, dst_start, c.width, nullptr),
             kernel.c_str());
    Equal(kernel, "d " + std::to_string(c.d) + ", " + std::to_string(c.n) + " rows x " + std::to_string(c.width) +
                      " slots" + (c.offset ? ", unaligned" : "") + " (bytes)",
          ddst.Host(), dst);
  }
}

void CheckLogprob() {
  struct Case { int64_t n, v; float scale; };
  for (const Case& c : {Case{37, 301, 1.0f / 0.7f}, Case{1, 301, 1.0f}, Case{300, 1024, 1.0f},
                        Case{64, 49152, 1.0f / 1.3f}}) {
    const auto logits = Normal(c.n * c.v, 4.0f);
    const auto labels = Integers(c.n, 0, c.v);
    const auto gl = Normal(c.n), ge = Normal(c.n);
    std::vector<float> logp(c.n), ent(c.n), lse(c.n), mz(c.n), grad(c.n * c.v), grad_logp_only(c.n * c.v);
    prl_cpu::LogprobForward(logits.data(), labels.data(), logp.data(), ent.data(), lse.data(), mz.data(), c.n, c.v,
                            c.scale);
    prl_cpu::LogprobBackward(logits.data(), labels.data(), lse.data(), mz.data(), gl.data(), ge.data(), grad.data(),
                             c.n, c.v, c.scale);
    prl_cpu::LogprobBackward(logits.data(), labels.data(), lse.data(), mz.data(), gl.data(), nullptr,
                             grad_logp_only.data(), c.n, c.v, c.scale);
    Device<float> dl(logits), dgl(gl), dge(ge), dlogp(c.n), dent(c.n), dlse(c.n), dmz(c.n), dgrad(c.n * c.v);
    Device<int64_t> dy(labels);
    Launched(prl_cuda::LogprobForward(dl.ptr, dy.ptr, dlogp.ptr, dent.ptr, dlse.ptr, dmz.ptr, c.n, c.v, c.scale,
                                      nullptr),
             "logprob");
    const std::string shape = "[" + std::to_string(c.n) + ", " + std::to_string(c.v) + "]";
    Close("logprob", shape + " logp", dlogp.Host(), logp, 2e-5);
    Close("logprob", shape + " entropy", dent.Host(), ent, 2e-5);
    Close("logprob", shape + " lse", dlse.Host(), lse, 2e-5);
    Close("logprob", shape + " mean_z", dmz.Host(), mz, 2e-5);
    // the backward from the CPU's saved statistics, so it is compared alone
    Device<float> clse(lse), cmz(mz);
    Launched(prl_cuda::LogprobBackward(dl.ptr, dy.ptr, clse.ptr, cmz.ptr, dgl.ptr, dge.ptr, dgrad.ptr, c.n, c.v,
                                       c.scale, nullptr),
             "logprob_grad");
    Close("logprob_grad", shape + " with entropy", dgrad.Host(), grad, 1e-4);
    Launched(prl_cuda::LogprobBackward(dl.ptr, dy.ptr, clse.ptr, cmz.ptr, dgl.ptr, nullptr, dgrad.ptr, c.n, c.v,
                                       c.scale, nullptr),
             "logprob_grad");
    Close("logprob_grad", shape + " log-prob only", dgrad.Host(), grad_logp_only, 1e-4);
  }
}

// bool vectors as bytes (std::vector<bool> holds bits)
using Bools = std::vector<uint8_t>;

void CheckStepUpdate() {
  struct Case { int64_t b, v; bool seen; int64_t n_stop, min_len; };
  for (const Case& c : {Case{1, 40, false, 2, 4}, Case{33, 40, true, 2, 4}, Case{33, 40, false, 0, 0},
                        Case{2000, 97, true, 3, 3}}) {
    const auto tokens = Integers(c.b, 0, 12), lengths = Integers(c.b, 0, 6);
    const auto logprob = Normal(c.b);
    const std::vector<int64_t> stop_ids = {3, 8, 11};
    const std::vector<int64_t> stop(stop_ids.begin(), stop_ids.begin() + c.n_stop);
    Bools finished(c.b);
    for (auto& f : finished) f = Uniform(1)[0] < 0.3f;
    std::vector<float> seen(c.seen ? c.b * c.v : 0);
    for (auto& s : seen) s = Uniform(1)[0] < 0.2f ? 1.0f : 0.0f;
    std::vector<int64_t> tk(c.b), ln(c.b);
    std::vector<float> lp(c.b), seen_cpu = seen;
    Bools fin(c.b), ban(c.b), done(1);
    prl_cpu::StepUpdate(tokens.data(), logprob.data(), reinterpret_cast<const bool*>(finished.data()),
                        lengths.data(), stop.data(), c.n_stop, c.seen ? seen_cpu.data() : nullptr, c.v, tk.data(),
                        lp.data(), reinterpret_cast<bool*>(fin.data()), ln.data(), reinterpret_cast<bool*>(ban.data()),
                        reinterpret_cast<bool*>(done.data()), c.b, 0, c.min_len);
    Device<int64_t> dtokens(tokens), dlengths(lengths), dstop(stop), dtk(c.b), dln(c.b);
    Device<float> dlogprob(logprob), dseen(seen), dlp(c.b);
    Device<uint8_t> dfinished(finished), dfin(c.b), dban(c.b), ddone(1);
    Launched(prl_cuda::StepUpdate(dtokens.ptr, dlogprob.ptr, reinterpret_cast<const bool*>(dfinished.ptr),
                                  dlengths.ptr, dstop.ptr, c.n_stop, c.seen ? dseen.ptr : nullptr, c.v, dtk.ptr,
                                  dlp.ptr, reinterpret_cast<bool*>(dfin.ptr), dln.ptr,
                                  reinterpret_cast<bool*>(dban.ptr), reinterpret_cast<bool*>(ddone.ptr), c.b, 0,
                                  c.min_len, nullptr),
             "step_update");
    const std::string what = std::to_string(c.b) + " rows" + (c.seen ? ", seen" : "");
    Equal("step_update", what + ": tokens", dtk.Host(), tk);
    Equal("step_update", what + ": logprob", dlp.Host(), lp);
    Equal("step_update", what + ": finished", dfin.Host(), fin);
    Equal("step_update", what + ": lengths", dln.Host(), ln);
    Equal("step_update", what + ": ban", dban.Host(), ban);
    Equal("step_update", what + ": done", ddone.Host(), done);
    if (c.seen) Equal("step_update", what + ": seen", dseen.Host(), seen_cpu);
  }
}

void CheckSample() {
  struct Setting { const char* name; float temperature; int top_k; float top_p; float penalty; };
  const Setting settings[] = {
      {"plain", 1.0f, 0, 1.0f, 1.0f},        {"temperature", 0.7f, 0, 1.0f, 1.0f},
      {"temperature_near_0", 1e-5f, 0, 1.0f, 1.0f}, {"greedy", 0.0f, 0, 1.0f, 1.0f},
      {"greedy_penalty", 0.0f, 0, 1.0f, 1.3f}, {"top_k_1", 1.0f, 1, 1.0f, 1.0f},
      {"top_k", 1.2f, 40, 1.0f, 1.0f},       {"top_p", 1.0f, 0, 0.6f, 1.0f},
      {"top_p_tiny", 1.0f, 0, 0.01f, 1.0f},  {"everything", 0.9f, 200, 0.8f, 1.2f}};
  const std::vector<int64_t> stop = {1, 5};
  for (const auto& [b, v] : std::vector<std::pair<int64_t, int64_t>>{{64, 4096}, {1, 97}, {16, 151936}}) {
    for (const Setting& s : settings) {
      const float spread = 0.5f + 3.5f * Uniform(1)[0];
      const auto logits = Normal(b * v, spread);
      std::vector<float> seen(b * v);
      for (auto& x : seen) x = Uniform(1)[0] < 0.05f ? 1.0f : 0.0f;
      Bools ban(b);
      for (auto& x : ban) x = Uniform(1)[0] < 0.5f;
      const auto u = Uniform(b);
      std::vector<int64_t> tokens(b);
      std::vector<float> logprob(b);
      prl_cpu::Sample(logits.data(), seen.data(), u.data(), reinterpret_cast<const bool*>(ban.data()), stop.data(),
                      2, tokens.data(), logprob.data(), b, v, s.temperature, s.top_k, s.top_p, s.penalty);
      Device<float> dl(logits), dseen(seen), du(u), dlp(b);
      Device<uint8_t> dban(ban);
      Device<int64_t> dstop(stop), dtok(b);
      Device<double> scratch(prl_cuda::SampleScratch(b, v));
      Launched(prl_cuda::Sample(dl.ptr, dseen.ptr, du.ptr, reinterpret_cast<const bool*>(dban.ptr), dstop.ptr, 2,
                                scratch.ptr, dtok.ptr, dlp.ptr, b, v, s.temperature, s.top_k, s.top_p, s.penalty,
                                nullptr),
               "sample");
      const std::string what = std::string(s.name) + ", " + std::to_string(b) + " x " + std::to_string(v);
      Equal("sample", what + ": tokens", dtok.Host(), tokens);
      Close("sample", what + ": log-prob", dlp.Host(), logprob, 2e-5);
    }
  }
}

// ------------------------------------------------------------------------------------------------ low precision

// The float32 weight the packed bytes stand for, [k, n] (int8: the integers, the scale applied after the sum), and
// the activations as the product takes them (rounded to bfloat16 when bf16_act): for the bound below.
std::vector<float> Dequantized(const std::vector<uint8_t>& packed, const std::vector<float>& scales, LowpFormat f,
                               int64_t k, int64_t n) {
  const int64_t k2 = (k + 1) / 2, groups = (k + prl::kLowpGroup - 1) / prl::kLowpGroup, P = prl::kLowpPanel;
  std::vector<float> w(k * n);
  for (int64_t i = 0; i < k; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t p = j / P, c = j % P;
      float v;
      if (f == LowpFormat::kBF16) {
        uint16_t h;
        std::memcpy(&h, packed.data() + 2 * ((p * k2 + i / 2) * 2 * P + 2 * c + i % 2), 2);
        v = BFloatBits(h);
      } else if (f == LowpFormat::kInt8) {
        v = static_cast<float>(static_cast<int8_t>(packed[(p * k + i) * P + c]));
      } else {
        const uint8_t b = packed[(p * k2 + i / 2) * P + c];
        const int q = ((i % 2 ? b >> 4 : b & 15) ^ 8) - 8;  // the nibble, sign-extended
        v = static_cast<float>(q) * scales[(p * groups + i / prl::kLowpGroup) * P + c];
      }
      w[i * n + j] = v;
    }
  }
  return w;
}

// gamma_m = m u / (1 - m u), u = 2^-24: the bound on the relative error of a float32 sum of m terms in any order
double Gamma(int64_t m) { return m * 0x1p-24 / (1.0 - m * 0x1p-24); }

// Each element within its own bound: |gpu - cpu| <= bound[i]. Printed like Close: the largest error relative to
// the output's scale, and as tol the largest bound relative to it.
void WithinBound(const std::string& kernel, const std::string& what, const std::vector<float>& gpu,
                 const std::vector<float>& cpu, const std::vector<double>& bound) {
  Result& r = For(kernel);
  double scale = 1.0, err = 0.0, tol = 0.0;
  size_t bad = gpu.size() == cpu.size() ? 0 : std::max(gpu.size(), cpu.size()), first = 0;
  for (size_t i = 0; i < cpu.size(); ++i) scale = std::max(scale, std::fabs(static_cast<double>(cpu[i])));
  for (size_t i = 0; i < std::min(gpu.size(), cpu.size()); ++i) {
    const double e = std::fabs(static_cast<double>(gpu[i]) - cpu[i]);
    err = std::max(err, std::isfinite(e) ? e : INFINITY);
    tol = std::max(tol, bound[i] / scale);
    if (!(e <= bound[i]) && bad++ == 0) first = i;
  }
  r.abs = std::max(r.abs, err);
  r.rel = std::max(r.rel, err / scale);
  r.tol = std::max(r.tol, tol);
  if (bad) {
    r.ok = false;
    char line[256];
    std::snprintf(line, sizeof(line), "%s: %zu of %zu elements past their bound (first at %zu: |%.9g - %.9g| > %.3g)",
                  what.c_str(), bad, cpu.size(), first, first < gpu.size() ? gpu[first] : NAN, cpu[first],
                  bound[first]);
    r.failures.push_back(line);
  }
}

// The GPU reads the bytes the CPU pack wrote. Both sum the same float32 products (int4: the same dequantized
// weights q s; int8: the scale applied once to the sum), in another order: the CPU k by k (K terms), the GPU 32
// interleaved partial sums of at most ceil(K / 32) + 1 products each, then those 32. Each is within gamma_m A of the
// exact sum of the products, A = sum_k |x_k w_kj| (times s_j for int8), so
//   |gpu - cpu| <= (gamma_{K+1} + gamma_{ceil(K/32)+34}) A + K 2^-125
// (the +1s: int8's scaling, a rounding of the result; the last term: the GPU build's flushing of subnormal products
// and activations to zero, --use_fast_math, which the CPU does not do).
void CheckPackedLinearLowp(LowpFormat f, bool bf16_act) {
  const std::string kernel = std::string("packed_linear_lowp[") +
                             (f == LowpFormat::kBF16 ? "bfloat16" : f == LowpFormat::kInt8 ? "int8" : "int4") +
                             (f != LowpFormat::kBF16 && bf16_act ? ",bf16_act" : "") + "]";
  struct Case { int64_t rows, k, n; };
  for (const Case& c : {Case{1, 64, 40}, Case{13, 130, 64}, Case{7, 301, 33}, Case{9, 257, 1},
                        Case{40, 1024, 4100}, Case{2, 4096, 96}}) {
    const auto x = Normal(c.rows * c.k);
    auto w = Normal(c.k * c.n, 0.1f);
    for (int64_t i = 0; i < c.k && c.n > 3; ++i) w[i * c.n + 3] = 0.0f;  // a zero column: scale 0
    std::vector<uint8_t> packed(prl::LowpPackedBytes(f, c.k, c.n));
    std::vector<float> scales(prl::LowpScaleCount(f, c.k, c.n)), y(c.rows * c.n);
    prl_cpu::PackWeightLowp(w.data(), f, packed.data(), scales.data(), c.k, c.n, false);
    prl_cpu::PackedLinearLowp(x.data(), packed.data(), scales.data(), f, y.data(), c.rows, c.k, c.n, bf16_act);
    Device<float> dx(x), ds(scales), dy(c.rows * c.n);
    Device<uint8_t> dp(packed);
    Launched(prl_cuda::PackedLinearLowp(dx.ptr, dp.ptr, ds.ptr, f, dy.ptr, c.rows, c.k, c.n, bf16_act, nullptr),
             kernel.c_str());

    const auto wq = Dequantized(packed, scales, f, c.k, c.n);
    std::vector<float> xq(x);
    if (f == LowpFormat::kBF16 || bf16_act)
      for (auto& v : xq) v = __bfloat162float(__float2bfloat16_rn(v));
    const double g = Gamma(c.k + 1) + Gamma((c.k + 31) / 32 + 34), floor = c.k * 0x1p-125;
    std::vector<double> bound(c.rows * c.n, 0.0);
    for (int64_t m = 0; m < c.rows; ++m) {
      for (int64_t i = 0; i < c.k; ++i) {
        const double xa = std::fabs(static_cast<double>(xq[m * c.k + i]));
        for (int64_t j = 0; j < c.n; ++j) bound[m * c.n + j] += xa * std::fabs(static_cast<double>(wq[i * c.n + j]));
      }
      for (int64_t j = 0; j < c.n; ++j) {
        const double s = f == LowpFormat::kInt8 ? scales[j] : 1.0;
        bound[m * c.n + j] = g * bound[m * c.n + j] * s + floor;
      }
    }
    WithinBound(kernel, std::to_string(c.rows) + " x " + std::to_string(c.k) + " x " + std::to_string(c.n),
                dy.Host(), y, bound);
  }
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t seed = 20240611;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr, "usage: %s [--seed N]\n", argv[0]);
      return 2;
    }
  }
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: %s; nothing compared\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "cudaGetDeviceCount found 0 devices");
    return 77;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  gpu_name = prop.name;
  std::printf("GPU 0: %s (sm_%d%d), seed %llu\n", prop.name, prop.major, prop.minor,
              static_cast<unsigned long long>(seed));
  rng.seed(seed);

  CheckRmsNorm();
  CheckSwiglu();
  CheckRotary();
  for (KvDtype t : {KvDtype::kFloat32, KvDtype::kBFloat16, KvDtype::kFloat16}) CheckRotaryQkvCache(t);
  for (KvDtype t : {KvDtype::kFloat32, KvDtype::kBFloat16, KvDtype::kFloat16}) CheckDecodeAttention(t);
  for (KvDtype t : {KvDtype::kFloat32, KvDtype::kBFloat16, KvDtype::kFloat16}) CheckKvPlace(t);
  CheckLogprob();
  CheckStepUpdate();
  CheckSample();
  CheckPackedLinearLowp(LowpFormat::kBF16, true);
  for (bool bf16_act : {false, true}) {
    CheckPackedLinearLowp(LowpFormat::kInt8, bf16_act);
    CheckPackedLinearLowp(LowpFormat::kInt4, bf16_act);
  }

  bool all = true;
  for (const auto& name : order) {
    const Result& r = results[name];
    for (const auto& f : r.failures) std::printf("  %s: %s\n", name.c_str(), f.c_str());
    std::printf("%-28s %-26s max_abs_err %-10.3g max_rel_err %-10.3g tol %-8.3g %s\n", name.c_str(),
                gpu_name.c_str(), r.abs, r.rel, r.tol, r.ok ? "PASS" : "FAIL");
    all = all && r.ok;
  }
  std::printf("%s: %zu kernels, %s\n", all ? "PASS" : "FAIL", order.size(),
              all ? "all equal the CPU kernels within tolerance" : "some differ from the CPU kernels");
  return all ? 0 : 1;
}
