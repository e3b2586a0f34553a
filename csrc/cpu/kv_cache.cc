// The rollout's KV-cache relayout, in place on dst:
//   prl_kv_place: dst[dst_row + i, :, dst_start:dst_start + width] = src[src_rows[i], :, src_start:src_start + width]
//                 for dst [Rd, H, Cd, D], src [Rs, H, Cs, D] of one dtype (the copy moves bytes: any dtype),
//                 src_rows int64 [n]; dst and src must not overlap. One memcpy per (row, head) window.
// The checks below run for both places; src_rows' values are checked on the CPU only (reading them on a GPU
// would wait for the device): the CUDA kernel skips a row outside [0, Rs) and leaves its dst window as it was.
#include "../prl_common.h"
#include "kernels.h"

void prl_cpu::KvPlace(void* dst, const void* src, const int64_t* rows, int64_t n, int64_t heads, int64_t d,
                      int64_t es, int64_t dst_cap, int64_t src_cap, int64_t dst_row, int64_t src_start,
                      int64_t dst_start, int64_t width) {
  char* dp = static_cast<char*>(dst);
  const char* sp = static_cast<const char*>(src);
  const int64_t dst_stride = dst_cap * d * es, src_stride = src_cap * d * es, bytes = width * d * es;
  prl::ParallelFor(n * heads, width * d, [&](int, int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / heads, h = w % heads;
      std::memcpy(dp + ((dst_row + i) * heads + h) * dst_stride + dst_start * d * es,
                  sp + (rows[i] * heads + h) * src_stride + src_start * d * es, static_cast<size_t>(bytes));
    }
  });
}

#ifndef PRL_NO_PADDLE
#ifdef PRL_WITH_CUDA
void KvPlaceCUDA(paddle::Tensor& dst, const paddle::Tensor& src, const paddle::Tensor& src_rows, int64_t dst_row,
                 int64_t src_start, int64_t dst_start, int64_t width);
#endif

namespace {

void CheckKvPlace(const paddle::Tensor& dst, const paddle::Tensor& src, const paddle::Tensor& src_rows,
                  int64_t dst_row, int64_t src_start, int64_t dst_start, int64_t width) {
  const char* op = "prl_kv_place";
  const auto& ds = dst.shape();
  const auto& ss = src.shape();
  PD_CHECK(ds.size() == 4 && ss.size() == 4, op, ": dst [Rd, H, Cd, D] and src [Rs, H, Cs, D] must be 4-D");
  PD_CHECK(ds[1] == ss[1] && ds[3] == ss[3], op, ": dst and src differ in heads or head_dim");
  PD_CHECK(dst.dtype() == src.dtype(), op, ": dst and src differ in dtype");
  PD_CHECK(dst.place() == src.place() && src_rows.place() == dst.place(), op,
           ": dst, src and src_rows must be on one place");
  PD_CHECK(dst.is_contiguous() && src.is_contiguous(), op, ": dst and src must be contiguous");
  PD_CHECK(src_rows.dtype() == paddle::DataType::INT64 && src_rows.shape().size() == 1, op,
           ": src_rows must be int64 [n]");
  const int64_t n = src_rows.numel();
  PD_CHECK(width >= 0 && src_start >= 0 && src_start + width <= ss[2] && dst_start >= 0 &&
               dst_start + width <= ds[2] && dst_row >= 0 && dst_row + n <= ds[0],
           op, ": window [", src_start, ", ", src_start + width, ") of ", ss[2], " slots -> rows [", dst_row, ", ",
           dst_row + n, ") of ", ds[0], ", slots [", dst_start, ", ", dst_start + width, ") of ", ds[2],
           " is out of bounds");
  const char* d0 = static_cast<const char*>(dst.data());
  const char* s0 = static_cast<const char*>(src.data());
  const int64_t es = static_cast<int64_t>(phi::SizeOf(dst.dtype()));
  PD_CHECK(dst.numel() == 0 || src.numel() == 0 || d0 + dst.numel() * es <= s0 || s0 + src.numel() * es <= d0, op,
           ": dst and src overlap");
}

}  // namespace

void KvPlace(paddle::Tensor& dst, const paddle::Tensor& src, const paddle::Tensor& src_rows, int64_t dst_row,
             int64_t src_start, int64_t dst_start, int64_t width) {
  CheckKvPlace(dst, src, src_rows, dst_row, src_start, dst_start, width);
  const int64_t n = src_rows.numel();
  if (n == 0 || width == 0) return;
#ifdef PRL_WITH_CUDA
  if (dst.is_gpu()) return KvPlaceCUDA(dst, src, src_rows, dst_row, src_start, dst_start, width);
#endif
  PD_CHECK(dst.is_cpu(), "prl_kv_place: dst must be a CPU or GPU tensor");
  const auto& ds = dst.shape();
  const auto& ss = src.shape();
  const int64_t heads = ds[1], d = ds[3], rs = ss[0];
  const int64_t es = static_cast<int64_t>(phi::SizeOf(dst.dtype()));
  const int64_t* rows = src_rows.data<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    PD_CHECK(rows[i] >= 0 && rows[i] < rs, "prl_kv_place: src_rows[", i, "] = ", rows[i], " outside [0, ", rs, ")");
  prl_cpu::KvPlace(dst.data(), src.data(), rows, n, heads, d, es, ds[2], ss[2], dst_row, src_start, dst_start,
                   width);
}

std::vector<std::vector<int64_t>> KvPlaceInferShape(const std::vector<int64_t>& dst, const std::vector<int64_t>& src,
                                                    const std::vector<int64_t>& src_rows, int64_t dst_row,
                                                    int64_t src_start, int64_t dst_start, int64_t width) {
  return {dst};
}

std::vector<paddle::DataType> KvPlaceInferDtype(paddle::DataType dst, paddle::DataType src, paddle::DataType rows) {
  return {dst};
}

PD_BUILD_OP(prl_kv_place)
    .Inputs({"Dst", "Src", "SrcRows"})
    .Outputs({"DstOut"})
    .Attrs({"dst_row: int64_t", "src_start: int64_t", "dst_start: int64_t", "width: int64_t"})
    .SetInplaceMap({{"Dst", "DstOut"}})
    .SetKernelFn(PD_KERNEL(KvPlace))
    .SetInferShapeFn(PD_INFER_SHAPE(KvPlaceInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(KvPlaceInferDtype));
#endif  // PRL_NO_PADDLE
