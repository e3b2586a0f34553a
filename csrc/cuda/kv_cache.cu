// CUDA KV-cache relayout (see csrc/cpu/kv_cache.cc, which checks shapes, bounds and overlap before calling
// this): one thread per unit of the widest of 16 / 8 / 4 / 2 / 1 bytes that the head's bytes and both base
// addresses allow, so float32 / float16 / bfloat16 windows of head_dim 64 or 128 copy in 16-byte units.
#include "prl_cuda.cuh"

namespace {

// dst [Rd, H, Cd, D], src [Rs, H, Cs, D] as units of `Unit`; `head` = units per slot (D * bytes / sizeof(Unit)).
template <typename Unit>
__global__ void KvPlaceKernel(Unit* dst, const Unit* src, const int64_t* src_rows, int64_t total, int64_t heads,
                              int64_t head, int64_t dst_cap, int64_t src_cap, int64_t src_count, int64_t dst_row,
                              int64_t src_start, int64_t dst_start, int64_t width) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= total) return;
  const int64_t window = width * head;  // units of one (row, head) window
  const int64_t u = idx % window, w = idx / window, h = w % heads, i = w / heads;
  const int64_t r = src_rows[i];
  if (r < 0 || r >= src_count) return;
  dst[(((dst_row + i) * heads + h) * dst_cap + dst_start) * head + u] =
      src[((r * heads + h) * src_cap + src_start) * head + u];
}

template <typename Unit>
void LaunchKvPlace(void* dst, const void* src, const int64_t* rows, int64_t n, int64_t heads, int64_t slot_bytes,
                   int64_t dst_cap, int64_t src_cap, int64_t src_count, int64_t dst_row, int64_t src_start,
                   int64_t dst_start, int64_t width, cudaStream_t stream) {
  const int64_t head = slot_bytes / static_cast<int64_t>(sizeof(Unit));
  const int64_t total = n * heads * width * head;
  KvPlaceKernel<Unit><<<prl_cuda::Blocks(total), prl_cuda::kThreads, 0, stream>>>(
      static_cast<Unit*>(dst), static_cast<const Unit*>(src), rows, total, heads, head, dst_cap, src_cap, src_count,
      dst_row, src_start, dst_start, width);
}

}  // namespace

cudaError_t prl_cuda::KvPlace(void* dst, const void* src, const int64_t* rows, int64_t n, int64_t heads, int64_t d,
                              int64_t elem_bytes, int64_t dst_cap, int64_t src_cap, int64_t src_count,
                              int64_t dst_row, int64_t src_start, int64_t dst_start, int64_t width,
                              cudaStream_t stream) {
  if (n == 0 || heads == 0 || width == 0 || d == 0) return cudaGetLastError();
  const int64_t slot_bytes = d * elem_bytes;
  const auto aligned = [&](int64_t unit) {
    return slot_bytes % unit == 0 && reinterpret_cast<uintptr_t>(dst) % unit == 0 &&
           reinterpret_cast<uintptr_t>(src) % unit == 0;
  };
  const auto launch = [&](auto unit) {
    LaunchKvPlace<decltype(unit)>(dst, src, rows, n, heads, slot_bytes, dst_cap, src_cap, src_count, dst_row,
                                  src_start, dst_start, width, stream);
  };
  if (aligned(16)) {
    launch(uint4{});
  } else if (aligned(8)) {
    launch(uint2{});
  } else if (aligned(4)) {
    launch(uint32_t{});
  } else if (aligned(2)) {
    launch(uint16_t{});
  } else {
    launch(uint8_t{});
  }
  return cudaGetLastError();
}

#ifndef PRL_NO_PADDLE
void KvPlaceCUDA(paddle::Tensor& dst, const paddle::Tensor& src, const paddle::Tensor& src_rows, int64_t dst_row,
                 int64_t src_start, int64_t dst_start, int64_t width) {
  const auto& ds = dst.shape();
  const auto& ss = src.shape();
  prl_cuda::CheckLaunch(
      prl_cuda::KvPlace(dst.data(), src.data(), src_rows.data<int64_t>(), src_rows.numel(), ds[1], ds[3],
                        static_cast<int64_t>(phi::SizeOf(dst.dtype())), ds[2], ss[2], ss[0], dst_row, src_start,
                        dst_start, width, dst.stream()),
      "prl_kv_place");
}
#endif  // PRL_NO_PADDLE
