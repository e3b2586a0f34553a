// Helpers shared by the CPU kernels of paddle_rl's fused ops.
// The kernels rely on the compiler's SIMD: `#pragma omp simd` marks reductions whose order may change.
// Kernels over many rows split them into contiguous parts with ParallelFor: an OpenMP parallel region when
// built with OpenMP against the runtime Paddle's MKL uses (libiomp5: its worker threads, still spinning after
// the last matmul, take the parts at once; separate threads would compete with them for the same cores),
// else std::threads. The split depends only on the thread count, so results are reproducible.
// With PRL_NO_PADDLE defined, the Paddle-facing helpers (tensor checks, dtype dispatch) are left out: the kernels'
// launchers (cpu/kernels.h) then compile without Paddle, as the standalone CUDA check builds them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#include "prl_kv_dtype.h"
#ifndef PRL_NO_PADDLE
#include "paddle/extension.h"
#endif

namespace prl {

constexpr float kNegInf = -1e9f;  // the additive "banned" logit of the pure-Paddle code

#ifndef PRL_NO_PADDLE
inline int64_t Rows(const paddle::Tensor& x) {
  const auto& s = x.shape();
  int64_t n = 1;
  for (size_t i = 0; i + 1 < s.size(); ++i) n *= s[i];
  return n;
}

inline int64_t LastDim(const paddle::Tensor& x) { return x.shape().back(); }
#endif

// Threads for ParallelFor: PADDLE_RL_OP_THREADS, else OMP_NUM_THREADS (read once), else the hardware's.
inline int NumThreads() {
  static const int n = [] {
    const char* env = std::getenv("PADDLE_RL_OP_THREADS");
    if (!env || !*env) env = std::getenv("OMP_NUM_THREADS");
    int v = env ? std::atoi(env) : 0;
    if (v <= 0) v = static_cast<int>(std::thread::hardware_concurrency());
    return std::max(1, std::min(v, 64));
  }();
  return n;
}

// The number of contiguous parts ParallelFor splits [0, n) into: up to NumThreads(), one when the work
// (n * elements_per_item) is below ~256K elements, where starting threads would cost more than it saves.
inline int ParallelParts(int64_t n, int64_t elements_per_item) {
  const int64_t parts = std::min<int64_t>(NumThreads(), n);
  if (parts <= 1 || n * elements_per_item < (int64_t{1} << 18)) return 1;
  const int64_t chunk = (n + parts - 1) / parts;
  return static_cast<int>((n + chunk - 1) / chunk);
}

// fn(part, begin, end) over the ParallelParts(n, elements_per_item) contiguous ranges of [0, n); the caller's
// thread takes part 0. fn must not throw.
template <typename Fn>
void ParallelFor(int64_t n, int64_t elements_per_item, Fn fn) {
  const int64_t parts = ParallelParts(n, elements_per_item);
  if (parts == 1) {
    fn(0, int64_t{0}, n);
    return;
  }
  const int64_t chunk = (n + parts - 1) / parts;
#ifdef _OPENMP
  if (omp_in_parallel()) {   // inside a parallel region (a decode layer's row range): the same parts, in turn
    for (int64_t p = 0; p < parts; ++p) fn(static_cast<int>(p), p * chunk, std::min(n, (p + 1) * chunk));
    return;
  }
#pragma omp parallel for num_threads(static_cast<int>(parts)) schedule(static, 1)
  for (int64_t p = 0; p < parts; ++p) fn(static_cast<int>(p), p * chunk, std::min(n, (p + 1) * chunk));
#else
  std::vector<std::thread> workers;
  for (int64_t p = 1; p < parts; ++p) workers.emplace_back(fn, static_cast<int>(p), p * chunk, std::min(n, (p + 1) * chunk));
  fn(0, int64_t{0}, std::min(n, chunk));
  for (auto& w : workers) w.join();
#endif
}

#ifndef PRL_NO_PADDLE
inline void CheckCpuFloat(const paddle::Tensor& x, const char* op, const char* name) {
  PD_CHECK(x.is_cpu(), op, ": ", name, " must be a CPU tensor");
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, op, ": ", name, " must be float32");
}
#endif

template <typename To, typename From>
inline To BitCast(From v) {
  static_assert(sizeof(To) == sizeof(From), "size mismatch");
  return __builtin_bit_cast(To, v);
}

// exp(x) in double; relative error <= ~2.3e-16; exactly 0 below -708.39 (where the reference's exp is subnormal or
// 0). GCC does not vectorize loops over it (its selects read as control flow): loops take ExpD4 (below) 4 lanes at
// a time and this one for the rest.
inline double ExpD(double x) {
  const double lo = -708.3964185322641, hi = 709.0;
  const double shifter = 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer kept in the low bits
  double xc = x < lo ? lo : (x > hi ? hi : x);
  double t = xc * 1.4426950408889634 + shifter;
  double n = t - shifter;
  double r = xc - n * 6.93147180369123816490e-01;
  r = r - n * 1.90821492927058770002e-10;
  double p = 1.0 / 6227020800.0;
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  const double scale = BitCast<double>((BitCast<uint64_t>(t) + 1023) << 52);
  return x < lo ? 0.0 : p * scale;
}

// exp(x) in float; relative error <= ~2e-7; exactly 0 below -87.3. Loops take ExpF8 (below) 8 lanes at a time and
// this one for the rest, as for ExpD.
inline float ExpF(float x) {
  const float lo = -87.33654f, hi = 88.0f;
  const float shifter = 12582912.0f;  // 1.5 * 2^23
  float xc = x < lo ? lo : (x > hi ? hi : x);
  float t = xc * 1.44269504f + shifter;
  float n = t - shifter;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float scale = BitCast<float>((BitCast<uint32_t>(t) + 127u) << 23);
  return x < lo ? 0.0f : p * scale;
}

typedef float V8 __attribute__((vector_size(32)));
typedef uint32_t U8 __attribute__((vector_size(32)));
typedef uint16_t H8 __attribute__((vector_size(16)));

// 8 consecutive floats
inline V8 Load8(const float* p) {
  V8 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline void Store8(float* p, V8 x) { std::memcpy(p, &x, sizeof(x)); }

// p[0 : cols) = the first cols of lo's and hi's 16 floats (cols <= 16): two stores for a whole row, else staged
inline void StoreCols16(float* p, V8 lo, V8 hi, int64_t cols) {
  if (cols == 16) {
    Store8(p, lo);
    Store8(p + 8, hi);
    return;
  }
  float row[16];
  Store8(row, lo);
  Store8(row + 8, hi);
  std::memcpy(p, row, cols * sizeof(float));
}

inline V8 Splat8(float v) { return V8{v, v, v, v, v, v, v, v}; }

inline float HSum8(V8 a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

// ExpF on 8 lanes: the same constants, clamping and operations in the same order, with vector compares and selects
// (no branch), so each lane equals ExpF of it bit for bit (tests/test_ops.py checks this through the kernels).
// On AVX2 one 256-bit register; the compiler splits it into halves where the target is narrower (SSE).
inline V8 ExpF8(V8 x) {
  const V8 lo = Splat8(-87.33654f), hi = Splat8(88.0f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23
  const V8 xc = x < lo ? lo : (x > hi ? hi : x);
  const V8 t = xc * 1.44269504f + shifter;
  const V8 n = t - shifter;
  V8 r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V8 p = Splat8(1.0f / 5040.0f);
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const V8 scale = BitCast<V8>((BitCast<U8>(t) + 127u) << 23);
  return x < lo ? Splat8(0.0f) : p * scale;
}

typedef double V4D __attribute__((vector_size(32)));
typedef uint64_t U4 __attribute__((vector_size(32)));
typedef float V4F __attribute__((vector_size(16)));

inline V4D Load4(const double* p) {
  V4D x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline void Store4(double* p, V4D x) { std::memcpy(p, &x, sizeof(x)); }

inline double HSum4(V4D a) { return (a[0] + a[2]) + (a[1] + a[3]); }

// The low and high 4 lanes of a V8 in double.
inline V4D LowD(V8 a) { return __builtin_convertvector((V4F{a[0], a[1], a[2], a[3]}), V4D); }
inline V4D HighD(V8 a) { return __builtin_convertvector((V4F{a[4], a[5], a[6], a[7]}), V4D); }

// ExpD on 4 lanes, each equal to ExpD of it bit for bit (as ExpF8 to ExpF).
inline V4D ExpD4(V4D x) {
  const V4D lo = V4D{1, 1, 1, 1} * -708.3964185322641, hi = V4D{1, 1, 1, 1} * 709.0;
  const double shifter = 6755399441055744.0;  // 1.5 * 2^52
  const V4D xc = x < lo ? lo : (x > hi ? hi : x);
  const V4D t = xc * 1.4426950408889634 + shifter;
  const V4D n = t - shifter;
  V4D r = xc - n * 6.93147180369123816490e-01;
  r = r - n * 1.90821492927058770002e-10;
  V4D p = V4D{1, 1, 1, 1} * (1.0 / 6227020800.0);
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  const V4D scale = BitCast<V4D>((BitCast<U4>(t) + uint64_t{1023}) << 52);
  return x < lo ? V4D{0, 0, 0, 0} : p * scale;
}

// x[i] = ExpF(x[i] - shift) for i < n (8 lanes at a time, the rest one by one); returns their sum (the vector
// lanes summed together, then the rest in order).
inline float ExpShiftSum(float* x, float shift, int64_t n) {
  V8 acc = Splat8(0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const V8 e = ExpF8(Load8(x + i) - shift);
    Store8(x + i, e);
    acc += e;
  }
  float sum = HSum8(acc);
  for (; i < n; ++i) {
    x[i] = ExpF(x[i] - shift);
    sum += x[i];
  }
  return sum;
}

// out[i] = scale * (the sum of a[i]'s lanes) for i < N; N = 8 and 4 reduce their vectors together (pairwise
// horizontal adds, a lane order of their own), other N one at a time.
template <int N>
inline void HSums(const V8* a, float scale, float* out) {
#ifdef __AVX__
  if constexpr (N == 8 || N == 4) {
    auto m = [&](int i) { return BitCast<__m256>(a[i]); };
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(m(0), m(1)), _mm256_hadd_ps(m(2), m(3)));
    if constexpr (N == 4) {
      const __m128 r = _mm_add_ps(_mm256_castps256_ps128(u0), _mm256_extractf128_ps(u0, 1));
      _mm_storeu_ps(out, _mm_mul_ps(r, _mm_set1_ps(scale)));
    } else {
      const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(m(4), m(5)), _mm256_hadd_ps(m(6), m(7)));
      const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
      _mm256_storeu_ps(out, _mm256_mul_ps(r, _mm256_set1_ps(scale)));
    }
    return;
  }
#endif
  for (int i = 0; i < N; ++i) out[i] = HSum8(a[i]) * scale;
}

inline float Dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Dot product for n % 8 == 0 with 8-wide vector accumulators (one horizontal sum at the end).
inline float Dot8(const float* a, const float* b, int64_t n) {
  V8 acc0 = {0, 0, 0, 0, 0, 0, 0, 0}, acc1 = acc0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 += Load8(a + i) * Load8(b + i);
    acc1 += Load8(a + i + 8) * Load8(b + i + 8);
  }
  for (; i < n; i += 8) acc0 += Load8(a + i) * Load8(b + i);
  return HSum8(acc0 + acc1);
}

// KV-cache elements: float32, or a 16-bit float (bfloat16, float16) that attention reads back as float32.
struct BF16 { uint16_t bits; };  // bfloat16 storage
struct F16 { uint16_t bits; };   // float16 storage

// fn(T{}) with T the element type of a KV cache of dtype t.
template <typename Fn>
void ForKvDtype(KvDtype t, Fn&& fn) {
  switch (t) {
    case KvDtype::kFloat32: return fn(float{});
    case KvDtype::kBFloat16: return fn(BF16{});
    case KvDtype::kFloat16: return fn(F16{});
  }
}

#ifndef PRL_NO_PADDLE
// Checks that t is a CPU tensor of float32, bfloat16 or float16 and returns its KvDtype.
inline KvDtype CpuKvDtype(const paddle::Tensor& t, const char* op, const char* name) {
  PD_CHECK(t.is_cpu(), op, ": ", name, " must be a CPU tensor");
  switch (t.dtype()) {
    case paddle::DataType::FLOAT32: return KvDtype::kFloat32;
    case paddle::DataType::BFLOAT16: return KvDtype::kBFloat16;
    case paddle::DataType::FLOAT16: return KvDtype::kFloat16;
    default: PD_THROW(op, ": ", name, " must be float32, bfloat16 or float16");
  }
}

// Checks that the caches k and v are CPU tensors of one KV-cache dtype and returns it.
inline KvDtype CpuCacheDtype(const paddle::Tensor& k, const paddle::Tensor& v, const char* op) {
  PD_CHECK(k.is_cpu() && v.is_cpu(), op, ": cache_k and cache_v must be CPU tensors");
  PD_CHECK(v.dtype() == k.dtype(), op, ": cache_v must match cache_k's dtype");
  return CpuKvDtype(k, op, "cache_k");
}
#endif

// float16 bits -> float32, exact (normal, subnormal, inf, nan)
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1fu) return BitCast<float>(sign | 0x7f800000u | (man << 13));
  if (exp != 0) return BitCast<float>(sign | ((exp + 112u) << 23) | (man << 13));
  const float mag = static_cast<float>(man) * 5.9604644775390625e-8f;  // man * 2^-24
  return sign ? -mag : mag;
}

inline float ToFloat(float x) { return x; }
inline float ToFloat(BF16 x) { return BitCast<float>(static_cast<uint32_t>(x.bits) << 16); }
inline float ToFloat(F16 x) { return HalfToFloat(x.bits); }

// float32 -> bfloat16 bits, rounded to nearest even; any NaN becomes 0x7fff (as Paddle's CPU cast)
inline uint16_t FloatToBFloat16(float v) {
  const uint32_t u = BitCast<uint32_t>(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// float32 -> float16 bits, IEEE round to nearest even (F16C's conversion; a NaN stays a quiet NaN)
inline uint16_t FloatToHalf(float v) {
#ifdef __F16C__
  return static_cast<uint16_t>(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
#else
  const uint32_t u = BitCast<uint32_t>(v), a = u & 0x7fffffffu;
  const uint32_t sign = (u >> 16) & 0x8000u;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // 65520 and above round to inf
  if (a >= 0x38800000u) {  // a normal half: rebias the exponent, drop 13 bits rounding to nearest even
    const uint32_t x = a - 0x38000000u;
    return static_cast<uint16_t>(sign | ((x + 0xfffu + ((x >> 13) & 1u)) >> 13));
  }
  if (a <= 0x33000000u) return static_cast<uint16_t>(sign);  // at most 2^-25: rounds to zero
  const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, shift = 126 - e;  // a subnormal half
  uint32_t r = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u), halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
#endif
}

// Paddle's casts (round to nearest even), so a cache written here equals one written by astype
inline void FromFloat(float v, float* out) { *out = v; }
inline void FromFloat(float v, BF16* out) { out->bits = FloatToBFloat16(v); }
inline void FromFloat(float v, F16* out) { out->bits = FloatToHalf(v); }

// 8 consecutive elements of a 16-bit cache as float32
inline V8 Load8(const BF16* p) {
  H8 h;
  std::memcpy(&h, p, sizeof(h));
  return BitCast<V8>(__builtin_convertvector(h, U8) << 16);
}
inline V8 Load8(const F16* p) {
#ifdef __F16C__
  return BitCast<V8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  V8 x;
  for (int i = 0; i < 8; ++i) x[i] = HalfToFloat(p[i].bits);
  return x;
#endif
}

}  // namespace prl
