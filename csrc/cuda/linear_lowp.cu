// CUDA twins of the rollout's low-precision packed products (see csrc/cpu/linear.cc: the three layouts, the
// rounding): bfloat16 weights x bfloat16 activations, weight_only_int8 (a scale per output column) and
// weight_only_int4 (a scale per 128 rows of K), reading the bytes the CPU pack (prl_pack_weight_bf16 / _int8 /
// _int4) wrote, copied to the GPU as they are.
//
// One block per (column panel, tile of up to kTileRows rows), 256 threads: each owns 4 adjacent columns of the
// panel (8 threads span its 32) and one of 32 slices of K: k-units slice, slice + 32, ..., a k-unit being one row
// of K (int8) or a pair of rows (bfloat16, int4). A warp's 32 threads thus read 4 consecutive k-units, contiguous
// bytes (512 for bfloat16, 128 for int8 / int4). The weights widen to float32 in registers (bfloat16: the half
// shifted up; int4: the nibble sign-extended, times its group's scale, as the CPU tiles do), each thread sums its
// k-units in k order with fused multiply-adds (bfloat16: the odd row, then the even one; int8 / int4: even, then
// odd), then the 32 slices' sums are added in slice order through shared memory and, for int8, multiplied by the
// column's scale once. The activations are rounded to bfloat16 (nearest even) in registers when bf16_act (always
// for bfloat16 weights); an odd K's missing row counts as 0. The same products as the CPU's; only the order of the
// float32 sums differs (32 interleaved partial sums, then their sum), so the two agree to float32 rounding, not
// bit for bit (csrc/cuda/test/prl_cuda_check.cu states the bound). Deterministic: no atomics.
#include "prl_cuda.cuh"

namespace {

using prl::LowpFormat;

constexpr int kSlices = 32;     // slices of K per block
constexpr int kColThreads = 8;  // threads per panel row: 4 columns each
constexpr int kTileRows = 8;    // rows per block
constexpr int kLowpThreads = kSlices * kColThreads;
constexpr int64_t kPanel = prl::kLowpPanel;
static_assert(kColThreads * 4 == kPanel, "8 threads of 4 columns span a panel");

__device__ __forceinline__ float RoundBF16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float LowHalf(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float HighHalf(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
// byte i of a word as a signed 8-bit integer; its low / high nibble as a signed 4-bit integer
__device__ __forceinline__ float Int8Of(uint32_t u, int i) { return static_cast<float>(static_cast<int>(u << (24 - 8 * i)) >> 24); }
__device__ __forceinline__ float LowNibble(uint32_t u, int i) { return static_cast<float>(static_cast<int>(u << (28 - 8 * i)) >> 28); }
__device__ __forceinline__ float HighNibble(uint32_t u, int i) { return static_cast<float>(static_cast<int>(u << (24 - 8 * i)) >> 28); }

template <LowpFormat F>
__global__ void __launch_bounds__(kLowpThreads) PackedLinearLowpKernel(const float* x, const void* packed,
                                                                       const float* scales, float* out, int64_t rows,
                                                                       int64_t k_dim, int64_t n, bool bf16_act) {
  __shared__ float partial[kSlices][kTileRows][kPanel];  // 32 KiB
  const int64_t p = blockIdx.x, m0 = static_cast<int64_t>(blockIdx.y) * kTileRows;
  const int tile_rows = static_cast<int>(rows - m0 < kTileRows ? rows - m0 : kTileRows);
  const int c4 = threadIdx.x % kColThreads, slice = threadIdx.x / kColThreads;
  const int64_t k2 = (k_dim + 1) / 2;
  const bool round = F == LowpFormat::kBF16 || bf16_act;
  const float* xt = x + m0 * k_dim;
  // x[m0 + r, k] as the product takes it (0 past K: an odd K's padding row)
  auto xv = [&](int r, int64_t k) {
    const float v = k < k_dim ? xt[r * k_dim + k] : 0.0f;
    return round ? RoundBF16(v) : v;
  };

  float acc[kTileRows][4];
#pragma unroll
  for (int r = 0; r < kTileRows; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.0f;

  if constexpr (F == LowpFormat::kBF16) {
    // [P, k2, 64] bfloat16: column j's pair at 2 j (the even row low, the odd row high in a 32-bit word)
    const uint16_t* panel = static_cast<const uint16_t*>(packed) + p * k2 * 2 * kPanel;
    for (int64_t kk = slice; kk < k2; kk += kSlices) {
      const uint4 u = *reinterpret_cast<const uint4*>(panel + kk * 2 * kPanel + c4 * 8);
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) {
        if (r < tile_rows) {
          const float xe = xv(r, 2 * kk), xo = xv(r, 2 * kk + 1);
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[r][i] = fmaf(xe, LowHalf(w[i]), fmaf(xo, HighHalf(w[i]), acc[r][i]));
        }
      }
    }
  } else if constexpr (F == LowpFormat::kInt8) {
    // [P, K, 32] int8
    const uint8_t* panel = static_cast<const uint8_t*>(packed) + p * k_dim * kPanel;
    for (int64_t k = slice; k < k_dim; k += kSlices) {
      const uint32_t u = *reinterpret_cast<const uint32_t*>(panel + k * kPanel + c4 * 4);
      float w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = Int8Of(u, i);
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) {
        if (r < tile_rows) {
          const float xk = xv(r, k);
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[r][i] = fmaf(xk, w[i], acc[r][i]);
        }
      }
    }
  } else {
    // [P, k2, 32] uint8 (the even row in the low nibble), scales [P, groups, 32]; a pair never straddles a group
    const uint8_t* panel = static_cast<const uint8_t*>(packed) + p * k2 * kPanel;
    const int64_t groups = (k_dim + prl::kLowpGroup - 1) / prl::kLowpGroup;
    const float* sp = scales + p * groups * kPanel + c4 * 4;
    for (int64_t kk = slice; kk < k2; kk += kSlices) {
      const uint32_t u = *reinterpret_cast<const uint32_t*>(panel + kk * kPanel + c4 * 4);
      const float* s = sp + (2 * kk / prl::kLowpGroup) * kPanel;
      float we[4], wo[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float si = s[i];
        we[i] = LowNibble(u, i) * si;
        wo[i] = HighNibble(u, i) * si;
      }
#pragma unroll
      for (int r = 0; r < kTileRows; ++r) {
        if (r < tile_rows) {
          const float xe = xv(r, 2 * kk), xo = xv(r, 2 * kk + 1);
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[r][i] = fmaf(xo, wo[i], fmaf(xe, we[i], acc[r][i]));
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kTileRows; ++r) {
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[slice][r][c4 * 4 + i] = acc[r][i];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < tile_rows * kPanel; idx += kLowpThreads) {
    const int r = idx / kPanel, j = idx % kPanel;
    const int64_t col = p * kPanel + j;
    if (col >= n) continue;  // a padded column of the last panel
    float sum = 0.0f;
    for (int s = 0; s < kSlices; ++s) sum += partial[s][r][j];
    if constexpr (F == LowpFormat::kInt8) sum *= scales[col];
    out[(m0 + r) * n + col] = sum;
  }
}

}  // namespace

cudaError_t prl_cuda::PackedLinearLowp(const float* x, const void* packed, const float* scales, LowpFormat format,
                                       float* out, int64_t rows, int64_t k_dim, int64_t n, bool bf16_act,
                                       cudaStream_t stream) {
  if (rows <= 0 || n <= 0) return cudaGetLastError();
  if (reinterpret_cast<uintptr_t>(packed) % 16 != 0) return cudaErrorMisalignedAddress;  // 16-byte loads
  const int64_t panels = prl::LowpPanels(n);
  constexpr int64_t kMaxTiles = 65535;  // gridDim.y
  for (int64_t m = 0; m < rows; m += kMaxTiles * kTileRows) {
    const int64_t chunk = rows - m < kMaxTiles * kTileRows ? rows - m : kMaxTiles * kTileRows;
    const dim3 grid(static_cast<unsigned>(panels), static_cast<unsigned>((chunk + kTileRows - 1) / kTileRows));
    const float* xm = x + m * k_dim;
    float* om = out + m * n;
    switch (format) {
      case LowpFormat::kBF16:
        PackedLinearLowpKernel<LowpFormat::kBF16><<<grid, kLowpThreads, 0, stream>>>(xm, packed, scales, om, chunk,
                                                                                    k_dim, n, true);
        break;
      case LowpFormat::kInt8:
        PackedLinearLowpKernel<LowpFormat::kInt8><<<grid, kLowpThreads, 0, stream>>>(xm, packed, scales, om, chunk,
                                                                                    k_dim, n, bf16_act);
        break;
      case LowpFormat::kInt4:
        PackedLinearLowpKernel<LowpFormat::kInt4><<<grid, kLowpThreads, 0, stream>>>(xm, packed, scales, om, chunk,
                                                                                    k_dim, n, bf16_act);
        break;
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

#ifndef PRL_NO_PADDLE
// prl_packed_linear_lowp on the GPU: csrc/cpu/linear.cc's op checked the shapes, dtypes and places.
std::vector<paddle::Tensor> PackedLinearLowpCUDA(const paddle::Tensor& x, const paddle::Tensor& packed,
                                                 const paddle::Tensor& scales, int64_t n, bool bf16_act) {
  const char* op = "prl_packed_linear_lowp";
  const LowpFormat format = packed.dtype() == paddle::DataType::BFLOAT16 ? LowpFormat::kBF16
                            : packed.dtype() == paddle::DataType::INT8   ? LowpFormat::kInt8
                                                                         : LowpFormat::kInt4;
  const int64_t k_dim = x.shape().back(), rows = k_dim > 0 ? x.numel() / k_dim : 0;
  std::vector<int64_t> shape = x.shape();
  shape.back() = n;
  auto out = paddle::empty(shape, x.dtype(), x.place());
  prl_cuda::CheckLaunch(prl_cuda::PackedLinearLowp(x.data<float>(), packed.data(), scales.data<float>(), format,
                                                   out.data<float>(), rows, k_dim, n, bf16_act, x.stream()),
                        op);
  return {out};
}
#endif  // PRL_NO_PADDLE
