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
void Launch(paddle::Tensor& dst, const paddle::Tensor& src, const paddle::Tensor& src_rows, int64_t unit_bytes,
            int64_t dst_row, int64_t src_start, int64_t dst_start, int64_t width) {
  const auto& ds = dst.shape();
  const auto& ss = src.shape();
  const int64_t n = src_rows.numel(), heads = ds[1];
  const int64_t head = ds[3] * static_cast<int64_t>(phi::SizeOf(dst.dtype())) / unit_bytes;
  const int64_t total = n * heads * width * head;
  KvPlaceKernel<Unit><<<prl_cuda::Blocks(total), prl_cuda::kThreads, 0, dst.stream()>>>(
      static_cast<Unit*>(dst.data()), static_cast<const Unit*>(src.data()), src_rows.data<int64_t>(), total, heads,
      head, ds[2], ss[2], ss[0], dst_row, src_start, dst_start, width);
}

}  // namespace

void KvPlaceCUDA(paddle::Tensor& dst, const paddle::Tensor& src, const paddle::Tensor& src_rows, int64_t dst_row,
                 int64_t src_start, int64_t dst_start, int64_t width) {
  const int64_t slot_bytes = dst.shape()[3] * static_cast<int64_t>(phi::SizeOf(dst.dtype()));
  const auto aligned = [&](int64_t unit) {
    return slot_bytes % unit == 0 && reinterpret_cast<uintptr_t>(dst.data()) % unit == 0 &&
           reinterpret_cast<uintptr_t>(src.data()) % unit == 0;
  };
  if (aligned(16)) {
    Launch<uint4>(dst, src, src_rows, 16, dst_row, src_start, dst_start, width);
  } else if (aligned(8)) {
    Launch<uint2>(dst, src, src_rows, 8, dst_row, src_start, dst_start, width);
  } else if (aligned(4)) {
    Launch<uint32_t>(dst, src, src_rows, 4, dst_row, src_start, dst_start, width);
  } else if (aligned(2)) {
    Launch<uint16_t>(dst, src, src_rows, 2, dst_row, src_start, dst_start, width);
  } else {
    Launch<uint8_t>(dst, src, src_rows, 1, dst_row, src_start, dst_start, width);
  }
  prl_cuda::CheckLaunch("prl_kv_place");
}
