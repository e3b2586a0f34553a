// Helpers of paddle_rl's CUDA kernels: block-wide reductions (blockDim.x a multiple of 32, at most 1024).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "paddle/extension.h"

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

inline void CheckLaunch(const char* op) {
  cudaError_t err = cudaGetLastError();
  PD_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace prl_cuda
