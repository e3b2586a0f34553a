// Helpers of paddle_rl's CUDA kernels: block-wide reductions (blockDim.x a multiple of 32, at most 1024), the KV
// cache's element types. Each csrc/cuda/*.cu holds its kernels and their launchers (launch.h), which need no
// Paddle, then its Paddle op's CUDA entry (tensors in, the launcher called on the tensors' stream) unless
// PRL_NO_PADDLE is defined; the helpers of those entries are at the end of this file, under the same guard.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "launch.h"
#ifndef PRL_NO_PADDLE
#include "paddle/extension.h"
#endif

namespace prl_cuda {

constexpr int kThreads = 256;
constexpr float kNegInf = -1e9f;

template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

template <typename T>
__device__ __forceinline__ T WarpMax(T v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    T other = __shfl_down_sync(0xffffffffu, v, offset);
    v = other > v ? other : v;
  }
  return v;
}

// Sum over the block, returned to every thread.
template <typename T>
__device__ T BlockSum(T v) {
  __shared__ T shared[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = WarpSum(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < warps ? shared[threadIdx.x] : T(0);
  if (warp == 0) v = WarpSum(v);
  if (threadIdx.x == 0) shared[0] = v;
  __syncthreads();
  return shared[0];
}

// Maximum over the block, returned to every thread.
template <typename T>
__device__ T BlockMax(T v, T lowest) {
  __shared__ T shared[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = WarpMax(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < warps ? shared[threadIdx.x] : lowest;
  if (warp == 0) v = WarpMax(v);
  if (threadIdx.x == 0) shared[0] = v;
  __syncthreads();
  return shared[0];
}

inline int Blocks(int64_t n, int threads = kThreads) { return static_cast<int>((n + threads - 1) / threads); }

// KV-cache elements (float32, bfloat16, float16): read as float32, written rounded to nearest even
__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ void FromFloat(float v, float* out) { *out = v; }
__device__ __forceinline__ void FromFloat(float v, __nv_bfloat16* out) { *out = __float2bfloat16_rn(v); }
__device__ __forceinline__ void FromFloat(float v, __half* out) { *out = __float2half_rn(v); }

// fn(T{}) with T the device element type of a KV cache of dtype t.
template <typename Fn>
void ForKvDtype(KvDtype t, Fn&& fn) {
  switch (t) {
    case KvDtype::kFloat32: return fn(float{});
    case KvDtype::kBFloat16: return fn(__nv_bfloat16{});
    case KvDtype::kFloat16: return fn(__half{});
  }
}

#ifndef PRL_NO_PADDLE
// A launcher's result as the op's error.
inline void CheckLaunch(cudaError_t err, const char* op) {
  PD_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

// The caches' KvDtype: k and v share one of float32, bfloat16, float16.
inline KvDtype CacheDtype(const paddle::Tensor& k, const paddle::Tensor& v, const char* op) {
  PD_CHECK(v.dtype() == k.dtype(), op, ": cache_v must match cache_k's dtype");
  switch (k.dtype()) {
    case paddle::DataType::FLOAT32: return KvDtype::kFloat32;
    case paddle::DataType::BFLOAT16: return KvDtype::kBFloat16;
    case paddle::DataType::FLOAT16: return KvDtype::kFloat16;
    default: PD_THROW(op, ": cache_k must be float32, bfloat16 or float16");
  }
}
#endif

}  // namespace prl_cuda
