// y = x W for the rollout's few rows, W read from a packed copy (see paddle_rl/ops/linear.py).
//   x [..., K] float32; packed [P, K, 32] float32: column panel p holds W[:, 32 p : 32 p + 32] (the last panel
//   zero-padded), each k's 32 weights adjacent up to K = 256; past that, as its two 16-column halves one after the
//   other ([K, 16] each: HalvesApart); n: W's columns (<= 32 P); out [..., n] float32.
// A panel is one contiguous stream, read from memory once per call and then from the L2 cache by each block of
// rows; each row's sums run over k in order, so a row's result does not depend on the other rows.
#include <cstdio>
#include <type_traits>

#include "../prl_common.h"
#include "../prl_lowp.h"
#include "kernels.h"

namespace {

constexpr int64_t kPanel = 32;  // columns per panel: four 8-float vectors
// Register tiles: MR rows x NV 8-float vectors of accumulators, NV weight vectors and a broadcast. AVX-512 (32
// vector registers): 6 rows x the whole panel (24 + 4 + 1). AVX2 (16): from 4 rows, 6 rows x half a panel (12 + 2 +
// 1), the panel in two halves (1.1-1.9x the 3 x 32 tile at the decode's shapes on a Zen 3, whose 12 + 4 + 1 registers
// spilled; at K 1536 too, where 6 rows of x no longer fit the L1 cache: 1.25-1.4x at W3's down projection, 66 rows);
// 1-3 rows, 3 rows x the whole panel, whose 4 accumulator chains a row keep the FMA units busy. Every tile sums each
// output over k in order: the same bits whichever tile.
#ifdef __AVX512F__
constexpr int kRows = 6, kVecs = 4;
#else
constexpr int kRows = 6, kVecs = 2;
#endif
constexpr int kRowsWhole = kVecs == 4 ? kRows : 3;   // rows of a whole-panel tile
constexpr int64_t kHalf = kPanel / 2;

// A half-panel tile reads 64 bytes a k step. Interleaved, those lie 128 bytes apart, in half of the L1 cache's sets
// and beside lines the tile does not read, which the hardware fetches with them; a half stored whole is one dense
// stream. W3's decode shapes (K 576 and 1536, weights from memory, 2 threads) multiplied 1.06-1.10x faster with the
// halves apart, W5's 1.12x (EPYC Zen 3, the layouts alternating in one process); at K 128 (the tiny defaults), where
// an interleaved half (8 KB) stays in the L1 cache, 0.96-1.0x: so apart past K = 256, where an interleaved half no
// longer fits its half of a 32 KB L1 (docs/kernels.md).
constexpr int64_t kInterleavedMaxK = 256;
inline bool HalvesApart(int64_t k_dim) { return k_dim > kInterleavedMaxK; }

// The next panel is fetched into the L2 cache while this one is multiplied, its 64-byte lines spread over the k steps
// of a column's tiles (FetchPlan: a line every 8 k steps at W3's 64 rows), where a panel takes at most
// kFetchPanelBytes (with the current one beside it, half of a Zen 3's 512 KB L2). A rollout's weights stream from
// memory once per decode step (W3: 425 MB in float32), too far apart for the hardware's prefetchers, which stop at page
// boundaries: W3's float32 rollout took 39.3-39.4 s with the fetch against 45.9-46.8 s without (EPYC Zen 3,
// alternated). The float32 and bfloat16 panels fetch; the int8 / int4 ones do not (their tiles wait on widening the
// weights, not on memory). A fetch changes no number.
constexpr int64_t kFetchPanelBytes = 256 << 10;
constexpr int64_t kLine = 64;   // bytes
constexpr int64_t kLineFloats = kLine / 4;

// How the `tiles` tiles of a column, `steps` k steps each, fetch `lines` lines: per_k lines every `every` k steps,
// tile_lines a tile, tile after tile. `every` is kSparse where the tiles still fetch every line at that rate (W3's 64
// rows, the quickstart's 256), else 1 (per_k 2 where even that is too sparse: a single tile).
constexpr int kSparse = 8;

struct FetchPlan {
  int every = 1, per_k = 1;
  int64_t lines, tile_lines;

  FetchPlan(int64_t lines, int64_t tiles, int64_t steps) : lines(lines) {
    const int64_t share = (lines + tiles - 1) / std::max<int64_t>(1, tiles);   // lines a tile
    if (steps / kSparse >= share) every = kSparse;
    if (steps / every < share) per_k = 2;
    tile_lines = per_k * (steps / every);
  }

  // where tile t fetches from (null once the tiles before it have fetched every line)
  const char* For(const void* from, int64_t t) const {
    return from && t * tile_lines < lines ? static_cast<const char*>(from) + t * tile_lines * kLine : nullptr;
  }
};

// fn(std::integral_constant<int, E>) for E = every (1 or kSparse): the tiles' unrolling between fetches
template <typename Fn>
inline void WithEvery(int every, Fn&& fn) {
  if (every == kSparse) return fn(std::integral_constant<int, kSparse>{});
  fn(std::integral_constant<int, 1>{});
}

// step(k) for k in [0, steps), with per_k lines from `fetch` (unless null) every EVERY steps, those unrolled. A
// prefetch and its address at every step cost the float32 tile (12 FMAs, 6 cycles a step) up to ~20%.
template <int EVERY, typename Step>
inline void FetchingSteps(int64_t steps, const char* fetch, int per_k, Step&& step) {
  int64_t k = 0;
  if (fetch) {
    for (; k + EVERY <= steps; k += EVERY, fetch += per_k * kLine) {
      for (int i = 0; i < per_k; ++i) __builtin_prefetch(fetch + i * kLine, 0, 1);
#pragma GCC unroll 8
      for (int e = 0; e < EVERY; ++e) step(k + e);
    }
  }
  for (; k < steps; ++k) step(k);
}

// Where a tile reads its weights: from `w`, k step after k step `ld` floats apart, its first two vectors adjacent
// and the next two (a whole-panel tile's) `hi` floats further (16 interleaved; 16 K with the halves apart)
struct Weights {
  const float* w;
  int64_t ld, hi;
};

// panel's weights as the tiles read them, its halves interleaved or `apart`
inline Weights PanelWeights(const float* panel, int64_t k_dim, bool apart) {
  return {panel, apart ? kHalf : kPanel, apart ? k_dim * kHalf : kHalf};
}

// out[m, 0 : cols] = sum_k x[m, k] w[k, 0 : cols] for the MR rows of a tile; wt: the tile's first column of a
// panel, cols <= 8 NV; fetch (or null): lines into the L2 cache, per_k every EVERY k steps
template <int MR, int NV, int EVERY = 1>
inline void Tile(const float* x, int64_t k_dim, Weights wt, float* out, int64_t ldo, int64_t cols,
                 const char* fetch = nullptr, int per_k = 1) {
  prl::V8 acc[MR][NV] = {};
  FetchingSteps<EVERY>(k_dim, fetch, per_k, [&](int64_t k) {
    const float* w = wt.w + k * wt.ld;
    prl::V8 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = prl::Load8(w + (v < 2 ? 8 * v : wt.hi + 8 * (v - 2)));
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * k_dim + k];
      for (int v = 0; v < NV; ++v) acc[m][v] += xv * wv[v];
    }
  });
  for (int m = 0; m < MR; ++m) {
    if (cols == 8 * NV) {
      std::memcpy(out + m * ldo, acc[m], sizeof(acc[m]));
    } else {
      float tmp[8 * NV];
      std::memcpy(tmp, acc[m], sizeof(tmp));
      std::memcpy(out + m * ldo, tmp, cols * sizeof(float));
    }
  }
}

// the last r < MR rows in one tile of their size
template <int R, int NV, int EVERY>
inline void LastTile(int64_t r, const float* x, int64_t k_dim, Weights w, float* out, int64_t ldo,
                     int64_t cols, const char* fetch, int per_k) {
  if constexpr (R >= 1) {
    if (r == R) return Tile<R, NV, EVERY>(x, k_dim, w, out, ldo, cols, fetch, per_k);
    LastTile<R - 1, NV, EVERY>(r, x, k_dim, w, out, ldo, cols, fetch, per_k);
  }
}

// rows [0, rows) of one panel's columns (w: the first of them, cols of them) in tiles of MR rows and NV vectors;
// the tiles fetch `fetch_lines` lines from `fetch` as FetchPlan spreads them (none where fetch is null)
template <int MR, int NV>
inline void Column(const float* x, int64_t rows, int64_t k_dim, Weights w, float* out, int64_t ldo,
                   int64_t cols, const float* fetch, int64_t fetch_lines) {
  const FetchPlan plan(fetch ? fetch_lines : 0, (rows + MR - 1) / MR, k_dim);
  WithEvery(plan.every, [&](auto every) {
    constexpr int E = decltype(every)::value;
    int64_t m = 0;
    for (; m + MR <= rows; m += MR) {
      Tile<MR, NV, E>(x + m * k_dim, k_dim, w, out + m * ldo, ldo, cols, plan.For(fetch, m / MR), plan.per_k);
    }
    if (m < rows) {
      LastTile<MR - 1, NV, E>(rows - m, x + m * k_dim, k_dim, w, out + m * ldo, ldo, cols, plan.For(fetch, m / MR),
                              plan.per_k);
    }
  });
}

// out[:, 32 p : 32 p + 32] (its first n - 32 p where fewer) from panel p (float32, its halves interleaved or `apart`),
// fetching `next` (the part's next panel, or null) as its columns' tiles run
void OnePanel(const float* x, const float* panel, float* out, int64_t rows, int64_t k_dim, int64_t n, int64_t p,
              const float* next, bool apart) {
  const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
  const int64_t panel_lines = k_dim * kPanel / kLineFloats;   // 2 k_dim
  const Weights whole = PanelWeights(panel, k_dim, apart);
  if (kVecs == 4 || rows <= 3) {
    Column<kRowsWhole, 4>(x, rows, k_dim, whole, out + col, n, cols, next, panel_lines);
    return;
  }
  // each half's column fetches its half of the next panel's lines
  for (int64_t first = 0, half = 0; first < cols; first += 8 * kVecs, ++half) {
    const float* fetch = next ? next + half * k_dim * kLineFloats : nullptr;
    Column<kRows, kVecs>(x, rows, k_dim, {panel + half * whole.hi, whole.ld, whole.hi}, out + col + first, n,
                         std::min<int64_t>(8 * kVecs, cols - first), fetch, panel_lines / 2);
  }
}

void Panels(const float* x, const float* packed, float* out, int64_t rows, int64_t k_dim, int64_t n, int64_t begin,
            int64_t end) {
  const bool fetches = k_dim * kPanel * static_cast<int64_t>(sizeof(float)) <= kFetchPanelBytes;
  for (int64_t p = begin; p < end; ++p) {
    const float* panel = packed + p * k_dim * kPanel;
    OnePanel(x, panel, out, rows, k_dim, n, p, fetches && p + 1 < end ? panel + k_dim * kPanel : nullptr,
             HalvesApart(k_dim));
  }
}

// panel p of W (0 past n) for k < k_dim, its halves interleaved ([K, 32]) or, with `apart`, one after the other:
// W [K, N], or [N, K] with transposed (then each source row is read in order)
inline void PanelIn(const float* w, int64_t k_dim, int64_t n, bool transposed, int64_t p, float* panel, bool apart) {
  const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
  const Weights at = PanelWeights(panel, k_dim, apart);
  if (cols < kPanel) std::fill(panel, panel + k_dim * kPanel, 0.0f);
  for (int64_t first = 0; first < cols; first += kHalf) {   // each half: columns first .. first + 15
    float* dst = panel + first / kHalf * at.hi;
    const int64_t width = std::min(kHalf, cols - first);
    if (transposed) {
      for (int64_t j = 0; j < width; ++j) {
        const float* row = w + (col + first + j) * k_dim;
        for (int64_t k = 0; k < k_dim; ++k) dst[k * at.ld + j] = row[k];
      }
    } else {
      for (int64_t k = 0; k < k_dim; ++k) std::memcpy(dst + k * at.ld, w + k * n + col + first, width * sizeof(float));
    }
  }
}

// panel p as the float32 tiles read it (HalvesApart)
inline void PanelOf(const float* w, int64_t k_dim, int64_t n, bool transposed, int64_t p, float* panel) {
  PanelIn(w, k_dim, n, transposed, p, panel, HalvesApart(k_dim));
}

}  // namespace

namespace prl_cpu {
// x [rows, k_dim] times W [k_dim, n] packed in float32 panels [ceil(n / 32), k_dim, 32] -> out [rows, n]. For the
// ops of this translation unit (prl_packed_linear, prl_decode_layer); not among kernels.h's launchers: a GPU
// multiplies by the weights themselves, so the standalone CUDA check has nothing to compare it with.
void PackedLinear(const float* x, const float* packed, float* out, int64_t rows, int64_t k_dim, int64_t n) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  prl::ParallelFor(panels, rows * k_dim * kPanel, [&](int, int64_t begin, int64_t end) {
    Panels(x, packed, out, rows, k_dim, n, begin, end);
  });
}
}  // namespace prl_cpu

#ifndef PRL_NO_PADDLE
// W [K, N] (or [N, K] with transposed) -> [P, K, 32], P = ceil(N / 32), the last panel zero-padded
std::vector<paddle::Tensor> PackWeight(const paddle::Tensor& w, bool transposed) {
  const char* op = "prl_pack_weight";
  prl::CheckCpuFloat(w, op, "weight");
  PD_CHECK(w.shape().size() == 2, op, ": weight must be 2-D");
  const int64_t k_dim = w.shape()[transposed ? 1 : 0], n = w.shape()[transposed ? 0 : 1];
  const int64_t panels = (n + kPanel - 1) / kPanel;
  auto out = paddle::empty({panels, k_dim, kPanel}, w.dtype(), w.place());
  const float* src = w.data<float>();
  float* dst = out.data<float>();
  prl::ParallelFor(panels, k_dim * kPanel, [&](int, int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) PanelOf(src, k_dim, n, transposed, p, dst + p * k_dim * kPanel);
  });
  return {out};
}

std::vector<std::vector<int64_t>> PackWeightInferShape(const std::vector<int64_t>& w, bool transposed) {
  const int64_t k_dim = w[transposed ? 1 : 0], n = w[transposed ? 0 : 1];
  return {{(n + kPanel - 1) / kPanel, k_dim, kPanel}};
}

std::vector<paddle::DataType> PackWeightInferDtype(paddle::DataType w) { return {w}; }

PD_BUILD_OP(prl_pack_weight)
    .Inputs({"W"})
    .Outputs({"Out"})
    .Attrs({"transposed: bool"})
    .SetKernelFn(PD_KERNEL(PackWeight))
    .SetInferShapeFn(PD_INFER_SHAPE(PackWeightInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PackWeightInferDtype));

std::vector<paddle::Tensor> PackedLinear(const paddle::Tensor& x, const paddle::Tensor& packed, int64_t n) {
  const char* op = "prl_packed_linear";
  prl::CheckCpuFloat(x, op, "x");
  prl::CheckCpuFloat(packed, op, "packed");
  const auto& ps = packed.shape();
  const int64_t k_dim = prl::LastDim(x), rows = prl::Rows(x);
  PD_CHECK(ps.size() == 3 && ps[1] == k_dim && ps[2] == kPanel, op, ": packed must be [P, K, 32] with K = x's last ",
           "dim (", k_dim, ")");
  PD_CHECK(n >= 1 && n <= ps[0] * kPanel && n > (ps[0] - 1) * kPanel, op, ": n ", n, " does not match ", ps[0],
           " panels");
  std::vector<int64_t> shape = x.shape();
  shape.back() = n;
  auto out = paddle::empty(shape, x.dtype(), x.place());
  prl_cpu::PackedLinear(x.data<float>(), packed.data<float>(), out.data<float>(), rows, k_dim, n);
  return {out};
}

std::vector<std::vector<int64_t>> PackedLinearInferShape(const std::vector<int64_t>& x,
                                                         const std::vector<int64_t>& packed, int64_t n) {
  std::vector<int64_t> out = x;
  out.back() = n;
  return {out};
}

std::vector<paddle::DataType> PackedLinearInferDtype(paddle::DataType x, paddle::DataType packed) { return {x}; }

PD_BUILD_OP(prl_packed_linear)
    .Inputs({"X", "Packed"})
    .Outputs({"Out"})
    .Attrs({"n: int64_t"})
    .SetKernelFn(PD_KERNEL(PackedLinear))
    .SetInferShapeFn(PD_INFER_SHAPE(PackedLinearInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PackedLinearInferDtype));
#endif  // PRL_NO_PADDLE

// ------------------------------------------------------------------------------------------------------------------
// The rollout's low-precision packed weights (rollout_dtype: bfloat16, rollout_quant_type: weight_only_int8 / int4).
// The column panels are those above (32 columns each, the last zero-padded); what a panel holds per format:
//   bfloat16 [P, ceil(K / 2), 64]: for each pair of rows (k = 2 kk, 2 kk + 1), column j's two weights adjacent
//     (index 2 j: the even k, 2 j + 1: the odd k), vdpbf16ps's layout; rounded to nearest even; an odd K ends
//     with a zero row. The activations are rounded to bfloat16 (nearest even) and each column sums, pair by pair,
//     acc += x[2 kk + 1] w[2 kk + 1], then acc += x[2 kk] w[2 kk] in float32 (exact products): vdpbf16ps's order
//     (without its flushing of subnormals to zero). The kernel widens the weights to float32 in registers and
//     uses fused multiply-adds (exact products: the same bits as separate adds); vdpbf16ps itself is not used:
//     on the Sapphire Rapids this was measured on, 2 FMAs per pair ran ~1.5x faster than one vdpbf16ps with the
//     weights in cache and as fast streaming them from memory.
//   int8 [P, K, 32] with scales [P * 32]: q = round_even(w / s), s = max_k |w[:, j]| / 127 per output column;
//     y = s_j * sum_k x[k] q[k, j] (sums over k in order, the scale applied once to the sum). Where the CPU has
//     AMX-BF16 the sums run on its tiles instead (csrc/cpu/bf16_matmul.cc PackedLinearInt8Amx): a 32-row step
//     of a panel is widened to bfloat16 (exact: |q| <= 127) in a 2 KB buffer, float32 activations enter as three
//     bfloat16 parts whose sum is x exactly (bf16_act: one, x rounded), every product is exact in float32 and the
//     tiles sum them in their order (float32 sums, even and odd steps in two accumulators added at the end); the
//     scale as above. PADDLE_RL_BF16_AMX=0 (or PADDLE_RL_BF16_EMULATE) keeps the AVX-512 tile.
//   int4 [P, ceil(K / 2), 32] uint8 with scales [P, ceil(K / 128), 32]: groups of 128 rows along K, q in [-7, 7]
//     (s = max |w| / 7 over the group), the even k in the low nibble; w = q s dequantized in registers (float32),
//     y = sum_k x[k] w[k, j] over k in order.
// int8 / int4 take float32 activations, or activations rounded to bfloat16 (bf16_act). Each format has an AVX-512
// tile (12 rows x 32 columns in registers, a k-step's weights converted once per tile) and a portable 8-wide one
// with the same arithmetic and bits, and an AVX2 one (6 rows x 16 columns) for builds without AVX-512; bfloat16 runs
// the portable one where the build has neither or PADDLE_RL_BF16_EMULATE is set (non-empty, not 0), and says so once
// on stderr.

namespace {

using prl::LowpFormat;
constexpr int64_t kQuantGroup = prl::kLowpGroup;  // int4: rows of K per scale
static_assert(kPanel == prl::kLowpPanel, "one panel width for every format");

inline uint16_t RoundBF16(float v) {  // round to nearest even (NaN stays NaN)
  const uint32_t u = prl::BitCast<uint32_t>(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float BF16ToFloat(uint16_t b) { return prl::BitCast<float>(static_cast<uint32_t>(b) << 16); }

bool EmulationForced() {
  const char* env = std::getenv("PADDLE_RL_BF16_EMULATE");
  return env && *env && std::strcmp(env, "0") != 0;
}

// Whether the bfloat16 and int8 products may run AMX tiles (where the CPU has them): PADDLE_RL_BF16_AMX=0 keeps
// them on their AVX-512 tiles (those of CPUs without AMX; tests compare the two)
bool AmxAllowed() {
  const char* env = std::getenv("PADDLE_RL_BF16_AMX");
  return !(env && std::strcmp(env, "0") == 0);
}

// float32 activations times int8 weights on AMX tiles: x as three bfloat16 parts, x exactly (two parts, 16 of x's
// 24 bits, ran up to 1.5x faster per product at SmolLM2-135M's shapes, with errors of 7-50 u against <= 0.8 u)
constexpr int kInt8AmxParts = 3;

// Whether this call runs the AVX-512 (or, built without AVX-512, the AVX2) bfloat16 tile; the first call that runs
// the portable one says why, once.
bool WideBF16() {
  const bool forced = EmulationForced();
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (!forced) return true;
  const char* why = "PADDLE_RL_BF16_EMULATE is set";
#else
  const char* why = forced ? "PADDLE_RL_BF16_EMULATE is set" : "the kernels were built without AVX2 and FMA";
#endif
  static bool warned = false;
  if (!warned) {
    warned = true;
    std::fprintf(stderr, "paddle_rl: the bfloat16 packed linear runs its portable 8-wide tile (%s)\n", why);
  }
  return false;
}

#ifdef __AVX512F__
// rows per AVX-512 tile: 12 x 2 accumulators, up to 4 weight vectors, a broadcast and int4's scales of 32 registers
constexpr int kRowsWide = 12;

inline __mmask16 HalfMask(int64_t cols, int half) {  // the columns of half (0: 0..15, 1: 16..31) that exist
  const int64_t c = std::max<int64_t>(0, std::min<int64_t>(16, cols - 16 * half));
  return c == 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << c) - 1);
}
#endif

// ---- bfloat16 weights x bfloat16 activations
// xp: the activations' rows as bfloat16 pairs (uint32: the even k in the low half), k2 pairs per row
template <int MR>
inline void TileBF16Portable(const uint32_t* xp, int64_t k2, const uint16_t* panel, float* out, int64_t ldo,
                             int64_t cols) {
  prl::V8 acc[MR][4] = {};
  for (int64_t kk = 0; kk < k2; ++kk) {
    prl::V8 even[4], odd[4];
    for (int i = 0; i < 4; ++i) {
      prl::U8 u;
      std::memcpy(&u, panel + kk * 2 * kPanel + i * 16, sizeof(u));
      even[i] = prl::BitCast<prl::V8>(u << 16);
      odd[i] = prl::BitCast<prl::V8>(u & 0xffff0000u);
    }
    for (int m = 0; m < MR; ++m) {
      const uint32_t x = xp[m * k2 + kk];
      const float xe = prl::BitCast<float>(x << 16), xo = prl::BitCast<float>(x & 0xffff0000u);
      for (int i = 0; i < 4; ++i) {
        acc[m][i] += xo * odd[i];   // products of two bfloat16 are exact in float32: fused or not, the same
        acc[m][i] += xe * even[i];
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    float tmp[kPanel];
    std::memcpy(tmp, acc[m], sizeof(tmp));
    std::memcpy(out + m * ldo, tmp, cols * sizeof(float));
  }
}


#ifdef __AVX512F__
// xf: the activations' rows as float32 (bfloat16 values), 2 k2 per row (an odd K's last one 0). A pair-row's 64
// weights widen to float32 in registers (the even k: the low half shifted up, the odd k: the high half masked) and
// each row sums acc += x[2 kk + 1] w[2 kk + 1], then acc += x[2 kk] w[2 kk]: exact products, so a fused
// multiply-add rounds as vdpbf16ps's separate add does, the same bits.
template <int MR, int EVERY>
inline void TileBF16Avx512(const float* xf, int64_t k2, const uint16_t* panel, float* out, int64_t ldo, int64_t cols,
                           const char* fetch, int per_k) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  FetchingSteps<EVERY>(k2, fetch, per_k, [&](int64_t kk) {
    const __m512i u0 = _mm512_loadu_si512(panel + kk * 2 * kPanel);
    const __m512i u1 = _mm512_loadu_si512(panel + kk * 2 * kPanel + 32);
    const __m512 e0 = _mm512_castsi512_ps(_mm512_slli_epi32(u0, 16));
    const __m512 e1 = _mm512_castsi512_ps(_mm512_slli_epi32(u1, 16));
    const __m512 o0 = _mm512_castsi512_ps(_mm512_and_si512(u0, high));
    const __m512 o1 = _mm512_castsi512_ps(_mm512_and_si512(u1, high));
    for (int m = 0; m < MR; ++m) {
      const __m512 xo = _mm512_set1_ps(xf[m * 2 * k2 + 2 * kk + 1]);
      const __m512 xe = _mm512_set1_ps(xf[m * 2 * k2 + 2 * kk]);
      acc[m][0] = _mm512_fmadd_ps(xe, e0, _mm512_fmadd_ps(xo, o0, acc[m][0]));
      acc[m][1] = _mm512_fmadd_ps(xe, e1, _mm512_fmadd_ps(xo, o1, acc[m][1]));
    }
  });
  const __mmask16 lo = HalfMask(cols, 0), hi = HalfMask(cols, 1);
  for (int m = 0; m < MR; ++m) {
    _mm512_mask_storeu_ps(out + m * ldo, lo, acc[m][0]);
    _mm512_mask_storeu_ps(out + m * ldo + 16, hi, acc[m][1]);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// The AVX2 tile (16 vector registers): TileBF16Avx512's arithmetic and order on half a panel (16 columns; half: the
// pair-row words of those columns) for 6 rows: 12 accumulators, the two weight vectors of the odd k, then of the even
// k, widened from words loaded again (L1) rather than kept, and the broadcast.
constexpr int kRowsAvx2 = 6;

// fn(first, width) for each 16-column half of a panel's `cols` columns that holds any: the AVX2 tiles' width
template <typename Fn>
inline void OverHalves(int64_t cols, Fn&& fn) {
  for (int64_t first = 0; first < cols; first += 16) fn(first, std::min<int64_t>(16, cols - first));
}

template <int MR, int EVERY>
inline void TileBF16Avx2(const float* xf, int64_t k2, const uint16_t* half, float* out, int64_t ldo, int64_t cols,
                         const char* fetch, int per_k) {
  prl::V8 acc[MR][2] = {};
  FetchingSteps<EVERY>(k2, fetch, per_k, [&](int64_t kk) {
    const uint16_t* w = half + kk * 2 * kPanel;
    prl::U8 u0, u1;
    std::memcpy(&u0, w, sizeof(u0));
    std::memcpy(&u1, w + 16, sizeof(u1));
    const prl::V8 o0 = prl::BitCast<prl::V8>(u0 & 0xffff0000u), o1 = prl::BitCast<prl::V8>(u1 & 0xffff0000u);
    for (int m = 0; m < MR; ++m) {
      const float xo = xf[m * 2 * k2 + 2 * kk + 1];
      acc[m][0] += xo * o0;
      acc[m][1] += xo * o1;
    }
    std::memcpy(&u0, w, sizeof(u0));
    std::memcpy(&u1, w + 16, sizeof(u1));
    const prl::V8 e0 = prl::BitCast<prl::V8>(u0 << 16), e1 = prl::BitCast<prl::V8>(u1 << 16);
    for (int m = 0; m < MR; ++m) {
      const float xe = xf[m * 2 * k2 + 2 * kk];
      acc[m][0] += xe * e0;
      acc[m][1] += xe * e1;
    }
  });
  for (int m = 0; m < MR; ++m) prl::StoreCols16(out + m * ldo, acc[m][0], acc[m][1], cols);
}
#endif

// ---- int8 / int4 weights x float32 activations (bfloat16-rounded ones are float32 values too)
typedef int8_t I8x8 __attribute__((vector_size(8)));

// 8 signed bytes as float32 (vpmovsxbd where there is AVX2: the generic conversion compiles to scalar code)
inline prl::V8 LoadInt8(const int8_t* p) {
#ifdef __AVX2__
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return prl::BitCast<prl::V8>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
#else
  I8x8 q;
  std::memcpy(&q, p, sizeof(q));
  return __builtin_convertvector(q, prl::V8);
#endif
}

template <int MR>
inline void TileInt8(const float* x, int64_t k_dim, const int8_t* panel, const float* scale, float* out, int64_t ldo,
                     int64_t cols) {
  prl::V8 acc[MR][4] = {};
  for (int64_t k = 0; k < k_dim; ++k) {
    const int8_t* w = panel + k * kPanel;
    const prl::V8 w0 = LoadInt8(w), w1 = LoadInt8(w + 8), w2 = LoadInt8(w + 16), w3 = LoadInt8(w + 24);
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * k_dim + k];
      acc[m][0] += xv * w0;
      acc[m][1] += xv * w1;
      acc[m][2] += xv * w2;
      acc[m][3] += xv * w3;
    }
  }
  const prl::V8 s[4] = {prl::Load8(scale), prl::Load8(scale + 8), prl::Load8(scale + 16), prl::Load8(scale + 24)};
  for (int m = 0; m < MR; ++m) {
    float tmp[kPanel];
    for (int i = 0; i < 4; ++i) std::memcpy(tmp + 8 * i, &(acc[m][i] = acc[m][i] * s[i]), sizeof(prl::V8));
    std::memcpy(out + m * ldo, tmp, cols * sizeof(float));
  }
}

typedef uint8_t U8x8 __attribute__((vector_size(8)));

template <int MR>
inline void TileInt4(const float* x, int64_t k_dim, const uint8_t* panel, const float* scales, float* out,
                     int64_t ldo, int64_t cols) {
  prl::V8 acc[MR][4] = {};
  for (int64_t k0 = 0; k0 < k_dim; k0 += kQuantGroup) {
    const float* sg = scales + (k0 / kQuantGroup) * kPanel;
    const prl::V8 s[4] = {prl::Load8(sg), prl::Load8(sg + 8), prl::Load8(sg + 16), prl::Load8(sg + 24)};
    const int64_t k1 = std::min(k_dim, k0 + kQuantGroup);
    for (int64_t k = k0; k < k1; k += 2) {
      const uint8_t* b = panel + (k / 2) * kPanel;
      prl::V8 we[4], wo[4];
      for (int i = 0; i < 4; ++i) {
        U8x8 v;
        std::memcpy(&v, b + 8 * i, sizeof(v));
        const I8x8 sv = prl::BitCast<I8x8>(v);
        we[i] = __builtin_convertvector((I8x8)(sv << 4) >> 4, prl::V8) * s[i];  // low nibble, sign-extended
        wo[i] = __builtin_convertvector(sv >> 4, prl::V8) * s[i];
      }
      for (int m = 0; m < MR; ++m) {
        const float xe = x[m * k_dim + k];
        for (int i = 0; i < 4; ++i) acc[m][i] += xe * we[i];
      }
      if (k + 1 < k1) {
        for (int m = 0; m < MR; ++m) {
          const float xo = x[m * k_dim + k + 1];
          for (int i = 0; i < 4; ++i) acc[m][i] += xo * wo[i];
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    float tmp[kPanel];
    std::memcpy(tmp, acc[m], sizeof(tmp));
    std::memcpy(out + m * ldo, tmp, cols * sizeof(float));
  }
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// The AVX2 tiles (16 vector registers): TileInt8's and TileInt4's arithmetic and order on half a panel (16 columns;
// half: those columns' first weight) for 6 rows: 12 accumulators, two weight vectors and the broadcast, where the
// tiles above keep 24 accumulators and 4-8 weight vectors and spill.
template <int MR>
inline void TileInt8Avx2(const float* x, int64_t k_dim, const int8_t* half, const float* scale, float* out,
                         int64_t ldo, int64_t cols) {
  prl::V8 acc[MR][2] = {};
  for (int64_t k = 0; k < k_dim; ++k) {
    const prl::V8 w0 = LoadInt8(half + k * kPanel), w1 = LoadInt8(half + k * kPanel + 8);
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * k_dim + k];
      acc[m][0] += xv * w0;
      acc[m][1] += xv * w1;
    }
  }
  const prl::V8 s0 = prl::Load8(scale), s1 = prl::Load8(scale + 8);
  for (int m = 0; m < MR; ++m) prl::StoreCols16(out + m * ldo, acc[m][0] * s0, acc[m][1] * s1, cols);
}

// the even (odd) k of a byte row's 8 columns: the low (high) nibble sign-extended, times the group's scales (the
// bytes sign-extended to int32 by vpmovsxbd: the generic conversion compiles to scalar code)
template <bool kOdd>
inline prl::V8 Int4Weights(const uint8_t* b, prl::V8 s) {
  const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  const __m256i q = kOdd ? _mm256_srai_epi32(x, 4) : _mm256_srai_epi32(_mm256_slli_epi32(x, 28), 28);
  return prl::BitCast<prl::V8>(_mm256_cvtepi32_ps(q)) * s;
}

template <int MR>
inline void TileInt4Avx2(const float* x, int64_t k_dim, const uint8_t* half, const float* scales, float* out,
                         int64_t ldo, int64_t cols) {
  prl::V8 acc[MR][2] = {};
  for (int64_t k0 = 0; k0 < k_dim; k0 += kQuantGroup) {
    const float* sg = scales + (k0 / kQuantGroup) * kPanel;
    const prl::V8 s0 = prl::Load8(sg), s1 = prl::Load8(sg + 8);
    const int64_t k1 = std::min(k_dim, k0 + kQuantGroup);
    for (int64_t k = k0; k < k1; k += 2) {
      const uint8_t* b = half + (k / 2) * kPanel;
      const prl::V8 we0 = Int4Weights<false>(b, s0), we1 = Int4Weights<false>(b + 8, s1);
      for (int m = 0; m < MR; ++m) {
        const float xe = x[m * k_dim + k];
        acc[m][0] += xe * we0;
        acc[m][1] += xe * we1;
      }
      if (k + 1 < k1) {
        const prl::V8 wo0 = Int4Weights<true>(b, s0), wo1 = Int4Weights<true>(b + 8, s1);
        for (int m = 0; m < MR; ++m) {
          const float xo = x[m * k_dim + k + 1];
          acc[m][0] += xo * wo0;
          acc[m][1] += xo * wo1;
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) prl::StoreCols16(out + m * ldo, acc[m][0], acc[m][1], cols);
}
#endif

#ifdef __AVX512F__
// The AVX-512 tiles: a k-step's 32 weights are loaded and converted to float32 once (two 16-float registers) and
// multiplied into all MR rows' accumulators (MR x 2 registers), the same arithmetic as the tiles above (a fused
// multiply-add per k in order), in registers the compiler does not scalarize.
inline __m512i LoadInt8x16(const void* p) {  // 16 signed bytes, sign-extended to int32
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
}

template <int MR>
inline void TileInt8Avx512(const float* x, int64_t k_dim, const int8_t* panel, const float* scale, float* out,
                           int64_t ldo, int64_t cols) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    const __m512 w0 = _mm512_cvtepi32_ps(LoadInt8x16(panel + k * kPanel));
    const __m512 w1 = _mm512_cvtepi32_ps(LoadInt8x16(panel + k * kPanel + 16));
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * k_dim + k]);
      acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
    }
  }
  const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
  const __mmask16 lo = HalfMask(cols, 0), hi = HalfMask(cols, 1);
  for (int m = 0; m < MR; ++m) {
    _mm512_mask_storeu_ps(out + m * ldo, lo, _mm512_mul_ps(acc[m][0], s0));
    _mm512_mask_storeu_ps(out + m * ldo + 16, hi, _mm512_mul_ps(acc[m][1], s1));
  }
}

template <int MR>
inline void TileInt4Avx512(const float* x, int64_t k_dim, const uint8_t* panel, const float* scales, float* out,
                           int64_t ldo, int64_t cols) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < k_dim; k0 += kQuantGroup) {
    const float* sg = scales + (k0 / kQuantGroup) * kPanel;
    const __m512 s0 = _mm512_loadu_ps(sg), s1 = _mm512_loadu_ps(sg + 16);
    const int64_t k1 = std::min(k_dim, k0 + kQuantGroup);
    for (int64_t k = k0; k < k1; k += 2) {
      const uint8_t* b = panel + (k / 2) * kPanel;
      const __m512i v0 = LoadInt8x16(b), v1 = LoadInt8x16(b + 16);  // a byte's high nibble keeps its sign
      {  // even k: the low nibble, sign-extended
        const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v0, 28), 28)), s0);
        const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v1, 28), 28)), s1);
        for (int m = 0; m < MR; ++m) {
          const __m512 xv = _mm512_set1_ps(x[m * k_dim + k]);
          acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
          acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
        }
      }
      if (k + 1 < k1) {  // odd k: the high nibble
        const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(v0, 4)), s0);
        const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(v1, 4)), s1);
        for (int m = 0; m < MR; ++m) {
          const __m512 xv = _mm512_set1_ps(x[m * k_dim + k + 1]);
          acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
          acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
        }
      }
    }
  }
  const __mmask16 lo = HalfMask(cols, 0), hi = HalfMask(cols, 1);
  for (int m = 0; m < MR; ++m) {
    _mm512_mask_storeu_ps(out + m * ldo, lo, acc[m][0]);
    _mm512_mask_storeu_ps(out + m * ldo + 16, hi, acc[m][1]);
  }
}
#endif

// Runs tile(MR, first row) over a panel's rows: tiles of MAX rows, then one tile of the rows left (MR a constant)
template <int R, typename Tile>
inline void LastRows(int64_t r, int64_t m, Tile& tile) {
  if constexpr (R >= 1) {
    if (r == R) return tile(std::integral_constant<int, R>{}, m);
    LastRows<R - 1>(r, m, tile);
  }
}

template <int MAX, typename Tile>
inline void OverRows(int64_t rows, Tile&& tile) {
  int64_t m = 0;
  for (; m + MAX <= rows; m += MAX) tile(std::integral_constant<int, MAX>{}, m);
  if (m < rows) LastRows<MAX - 1>(rows - m, m, tile);
}

// q = round_even(v / s) clipped to [-lim, lim], 0 where s is 0, for a row of 32 columns
inline void QuantizeRow(const float* v, const float* s, float lim, float* q) {
  for (int64_t j = 0; j < kPanel; ++j) {
    const float r = std::nearbyint(v[j] / (s[j] > 0.0f ? s[j] : 1.0f));
    q[j] = s[j] > 0.0f ? std::max(-lim, std::min(lim, r)) : 0.0f;
  }
}

// Panel p of int4 weights as float32 [k_dim, 32] in dst: each nibble times its group's scale, one rounding, as the
// tiles widen it. With more than one tile of rows the int4 tiles widen a panel's nibbles again for every tile (11
// times at W3's 64 rows: two shifts, a conversion and a product per 8 weights, more than the FMAs they feed); widened
// once, the float32 tiles multiply them from the cache: the same products, summed over k in order, the same bits.
// int8 stays with its tiles: their half-panel (a quarter of float32's bytes) stays in the L1 cache and widens in two
// instructions, where a widened copy is read from L2 (W3's decode shapes: int8 0.91-1.00x float32's rate that way,
// 1.02-1.18x with its tiles, in the same processes). The widened panel stays interleaved at any K: written with its
// halves apart (HalvesApart), W3's int4 products took 1.19-1.21x as long (the same bits; the panel is in the L2 cache
// just written, and the widening runs in 16-column halves).
inline void WidenInt4Panel(const uint8_t* packed, const float* scales, int64_t k_dim, int64_t p, float* dst) {
  const int64_t k2 = (k_dim + 1) / 2, groups = (k_dim + kQuantGroup - 1) / kQuantGroup;
  const uint8_t* src = packed + p * k2 * kPanel;
  const float* sp = scales + p * groups * kPanel;
  for (int64_t kk = 0; kk < k2; ++kk) {
    const float* s = sp + (2 * kk / kQuantGroup) * kPanel;   // a byte's two rows share the group (kQuantGroup even)
    const uint8_t* b = src + kk * kPanel;
    float* even = dst + 2 * kk * kPanel;
    for (int64_t j = 0; j < kPanel; ++j) {
      even[j] = static_cast<float>(static_cast<int8_t>(static_cast<uint8_t>(b[j] << 4)) >> 4) * s[j];
    }
    if (2 * kk + 1 < k_dim) {
      float* odd = even + kPanel;
      for (int64_t j = 0; j < kPanel; ++j) odd[j] = static_cast<float>(static_cast<int8_t>(b[j]) >> 4) * s[j];
    }
  }
}

// s[j] = max |panel[k, j]| / div over rows [k0, k1)
inline void ColumnScales(const float* panel, int64_t k0, int64_t k1, float div, float* s) {
  float amax[kPanel] = {};
  for (int64_t k = k0; k < k1; ++k) {
    for (int64_t j = 0; j < kPanel; ++j) amax[j] = std::max(amax[j], std::fabs(panel[k * kPanel + j]));
  }
  for (int64_t j = 0; j < kPanel; ++j) s[j] = amax[j] / div;
}

}  // namespace

// The low-precision packs first copy each panel to float32 [K, 32] (PanelIn, interleaved), then convert it row by
// row: 32 adjacent columns per step, loops the compiler vectorizes, whichever layout the source has.
void prl_cpu::PackWeightLowp(const float* w, LowpFormat format, void* packed, float* scales, int64_t k_dim,
                             int64_t n, bool transposed) {
  const int64_t panels = (n + kPanel - 1) / kPanel, k2 = (k_dim + 1) / 2;
  const int64_t groups = (k_dim + kQuantGroup - 1) / kQuantGroup;
  if (format == LowpFormat::kBF16) {
    uint16_t* dst = static_cast<uint16_t*>(packed);
    scales[0] = 0.0f;
    prl::ParallelFor(panels, k_dim * kPanel, [&](int, int64_t begin, int64_t end) {
      std::vector<float> buf(2 * k2 * kPanel, 0.0f);  // an odd K's last row stays 0
      for (int64_t p = begin; p < end; ++p) {
        PanelIn(w, k_dim, n, transposed, p, buf.data(), false);
        for (int64_t kk = 0; kk < k2; ++kk) {
          const float* even = buf.data() + 2 * kk * kPanel;
          const float* odd = even + kPanel;
          uint16_t* d = dst + (p * k2 + kk) * 2 * kPanel;
          for (int64_t j = 0; j < kPanel; ++j) {
            d[2 * j] = RoundBF16(even[j]);
            d[2 * j + 1] = RoundBF16(odd[j]);
          }
        }
      }
    });
  } else if (format == LowpFormat::kInt8) {
    int8_t* dst = static_cast<int8_t*>(packed);
    prl::ParallelFor(panels, k_dim * kPanel, [&](int, int64_t begin, int64_t end) {
      std::vector<float> buf(k_dim * kPanel);
      for (int64_t p = begin; p < end; ++p) {
        PanelIn(w, k_dim, n, transposed, p, buf.data(), false);
        float* s = scales + p * kPanel;
        ColumnScales(buf.data(), 0, k_dim, 127.0f, s);
        for (int64_t k = 0; k < k_dim; ++k) {
          float q[kPanel];
          QuantizeRow(buf.data() + k * kPanel, s, 127.0f, q);
          int8_t* d = dst + (p * k_dim + k) * kPanel;
          for (int64_t j = 0; j < kPanel; ++j) d[j] = static_cast<int8_t>(q[j]);
        }
      }
    });
  } else {
    uint8_t* dst = static_cast<uint8_t*>(packed);
    prl::ParallelFor(panels, k_dim * kPanel, [&](int, int64_t begin, int64_t end) {
      std::vector<float> buf(2 * k2 * kPanel, 0.0f);  // an odd K's last row stays 0 (its nibble 0)
      for (int64_t p = begin; p < end; ++p) {
        PanelIn(w, k_dim, n, transposed, p, buf.data(), false);
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t k0 = g * kQuantGroup, k1 = std::min(k_dim, k0 + kQuantGroup);
          float* s = scales + (p * groups + g) * kPanel;
          ColumnScales(buf.data(), k0, k1, 7.0f, s);
          for (int64_t k = k0; k < k1; k += 2) {  // k0 is even: a byte's two rows share the group
            float lo[kPanel], hi[kPanel] = {};
            QuantizeRow(buf.data() + k * kPanel, s, 7.0f, lo);
            if (k + 1 < k1) QuantizeRow(buf.data() + (k + 1) * kPanel, s, 7.0f, hi);
            uint8_t* d = dst + (p * k2 + k / 2) * kPanel;
            for (int64_t j = 0; j < kPanel; ++j) {
              const int l = static_cast<int>(lo[j]) & 0xf, h = static_cast<int>(hi[j]) & 0xf;
              d[j] = static_cast<uint8_t>(l | (h << 4));
            }
          }
        }
      }
    });
  }
}

void prl_cpu::PackedLinearLowp(const float* xs, const void* packed, const float* sc, LowpFormat format, float* o,
                               int64_t rows, int64_t k_dim, int64_t n, bool bf16_act) {
  const int64_t k2 = (k_dim + 1) / 2, panels = (n + kPanel - 1) / kPanel;
  const int64_t groups = (k_dim + kQuantGroup - 1) / kQuantGroup;
  const int64_t work = rows * k_dim * kPanel;

  if (format == LowpFormat::kBF16) {
    std::vector<uint32_t> xp(rows * k2);  // the rows as bfloat16 pairs, an odd K's last pair padded with 0
    for (int64_t m = 0; m < rows; ++m) {
      for (int64_t kk = 0; kk < k2; ++kk) {
        const float hi = 2 * kk + 1 < k_dim ? xs[m * k_dim + 2 * kk + 1] : 0.0f;
        xp[m * k2 + kk] = RoundBF16(xs[m * k_dim + 2 * kk]) | (static_cast<uint32_t>(RoundBF16(hi)) << 16);
      }
    }
    const uint16_t* pw = static_cast<const uint16_t*>(packed);
    if (!EmulationForced() && AmxAllowed() && PackedLinearBF16Amx(xp.data(), pw, o, rows, k2, n)) return;
    const bool wide = WideBF16();
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    std::vector<float> xf;  // the pairs as float32: what the AVX-512 and AVX2 tiles broadcast
    if (wide) {
      xf.resize(rows * 2 * k2);
      for (int64_t i = 0; i < rows * k2; ++i) {
        xf[2 * i] = prl::BitCast<float>(xp[i] << 16);
        xf[2 * i + 1] = prl::BitCast<float>(xp[i] & 0xffff0000u);
      }
    }
#endif
    // a panel: k2 pair-rows of 128 bytes; the wide tiles fetch the part's next one as the float32 tiles do
    const int64_t panel_bytes = k2 * 2 * kPanel * static_cast<int64_t>(sizeof(uint16_t));
    prl::ParallelFor(panels, work, [&](int, int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const uint16_t* panel = pw + p * k2 * 2 * kPanel;
        const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
        [[maybe_unused]] const uint16_t* next =
            p + 1 < end && panel_bytes <= kFetchPanelBytes ? panel + k2 * 2 * kPanel : nullptr;
#ifdef __AVX512F__
        if (wide) {
          const FetchPlan plan(next ? panel_bytes / kLine : 0, (rows + kRowsWide - 1) / kRowsWide, k2);
          WithEvery(plan.every, [&](auto every) {
            OverRows<kRowsWide>(rows, [&](auto mr, int64_t m) {
              TileBF16Avx512<decltype(mr)::value, decltype(every)::value>(
                  xf.data() + m * 2 * k2, k2, panel, o + m * n + col, n, cols, plan.For(next, m / kRowsWide),
                  plan.per_k);
            });
          });
          continue;
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if (wide) {
          // each half's column fetches its half of the next panel's bytes
          const FetchPlan plan(next ? panel_bytes / 2 / kLine : 0, (rows + kRowsAvx2 - 1) / kRowsAvx2, k2);
          OverHalves(cols, [&](int64_t first, int64_t width) {
            const char* from = next ? reinterpret_cast<const char*>(next) + first / 16 * (panel_bytes / 2) : nullptr;
            WithEvery(plan.every, [&](auto every) {
              OverRows<kRowsAvx2>(rows, [&](auto mr, int64_t m) {
                TileBF16Avx2<decltype(mr)::value, decltype(every)::value>(
                    xf.data() + m * 2 * k2, k2, panel + 2 * first, o + m * n + col + first, n, width,
                    plan.For(from, m / kRowsAvx2), plan.per_k);
              });
            });
          });
          continue;
        }
#endif
        OverRows<kRows>(rows, [&](auto mr, int64_t m) {
          TileBF16Portable<decltype(mr)::value>(xp.data() + m * k2, k2, panel, o + m * n + col, n, cols);
        });
      }
    });
    (void)wide;
    return;
  }

  if (format == LowpFormat::kInt8 && !EmulationForced() && AmxAllowed()) {
    const int parts = bf16_act ? 1 : kInt8AmxParts;
    if (PackedLinearInt8Amx(xs, parts, static_cast<const int8_t*>(packed), sc, o, rows, k_dim, n)) return;
  }
  std::vector<float> rounded;
  if (bf16_act) {
    rounded.resize(rows * k_dim);
    for (int64_t i = 0; i < rows * k_dim; ++i) rounded[i] = BF16ToFloat(RoundBF16(xs[i]));
    xs = rounded.data();
  }
  if (format == LowpFormat::kInt4 && rows > kRows) {   // more than one float32 tile of rows: WidenInt4Panel
    prl::ParallelFor(panels, work, [&](int, int64_t begin, int64_t end) {
      std::vector<float> wide(k_dim * kPanel);
      for (int64_t p = begin; p < end; ++p) {
        WidenInt4Panel(static_cast<const uint8_t*>(packed), sc, k_dim, p, wide.data());
        OnePanel(xs, wide.data(), o, rows, k_dim, n, p, nullptr, false);   // interleaved: see WidenInt4Panel
      }
    });
    return;
  }
  if (format == LowpFormat::kInt8) {
    const int8_t* pw = static_cast<const int8_t*>(packed);
    prl::ParallelFor(panels, work, [&](int, int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
#ifdef __AVX512F__
        OverRows<kRowsWide>(rows, [&](auto mr, int64_t m) {
          TileInt8Avx512<decltype(mr)::value>(xs + m * k_dim, k_dim, pw + p * k_dim * kPanel, sc + col,
                                              o + m * n + col, n, cols);
        });
#elif defined(__AVX2__) && defined(__FMA__)
        OverHalves(cols, [&](int64_t first, int64_t width) {
          OverRows<kRowsAvx2>(rows, [&](auto mr, int64_t m) {
            TileInt8Avx2<decltype(mr)::value>(xs + m * k_dim, k_dim, pw + p * k_dim * kPanel + first, sc + col + first,
                                              o + m * n + col + first, n, width);
          });
        });
#else
        OverRows<kRows>(rows, [&](auto mr, int64_t m) {
          TileInt8<decltype(mr)::value>(xs + m * k_dim, k_dim, pw + p * k_dim * kPanel, sc + col, o + m * n + col,
                                        n, cols);
        });
#endif
      }
    });
  } else {
    const uint8_t* pw = static_cast<const uint8_t*>(packed);
    prl::ParallelFor(panels, work, [&](int, int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t col = p * kPanel, cols = std::min(kPanel, n - col);
#ifdef __AVX512F__
        OverRows<kRowsWide>(rows, [&](auto mr, int64_t m) {
          TileInt4Avx512<decltype(mr)::value>(xs + m * k_dim, k_dim, pw + p * k2 * kPanel, sc + p * groups * kPanel,
                                              o + m * n + col, n, cols);
        });
#elif defined(__AVX2__) && defined(__FMA__)
        OverHalves(cols, [&](int64_t first, int64_t width) {
          OverRows<kRowsAvx2>(rows, [&](auto mr, int64_t m) {
            TileInt4Avx2<decltype(mr)::value>(xs + m * k_dim, k_dim, pw + p * k2 * kPanel + first,
                                              sc + p * groups * kPanel + first, o + m * n + col + first, n, width);
          });
        });
#else
        OverRows<kRows>(rows, [&](auto mr, int64_t m) {
          TileInt4<decltype(mr)::value>(xs + m * k_dim, k_dim, pw + p * k2 * kPanel, sc + p * groups * kPanel,
                                        o + m * n + col, n, cols);
        });
#endif
      }
    });
  }
}

#ifndef PRL_NO_PADDLE
namespace {

// the format a packed tensor's dtype names (bfloat16 / int8 / uint8)
LowpFormat FormatOf(const paddle::Tensor& packed, const char* op) {
  switch (packed.dtype()) {
    case paddle::DataType::BFLOAT16: return LowpFormat::kBF16;
    case paddle::DataType::INT8: return LowpFormat::kInt8;
    case paddle::DataType::UINT8: return LowpFormat::kInt4;
    default: PD_THROW(op, ": packed must be bfloat16 (bfloat16 weights), int8 (weight_only_int8) or uint8 ",
                      "(weight_only_int4)");
  }
}

// data and scales of W [K, N] (or [N, K] transposed) packed in `format` by the launcher
std::vector<paddle::Tensor> PackLowp(const paddle::Tensor& w, bool transposed, LowpFormat format, const char* op) {
  prl::CheckCpuFloat(w, op, "weight");
  PD_CHECK(w.shape().size() == 2, op, ": weight must be 2-D");
  const int64_t k_dim = w.shape()[transposed ? 1 : 0], n = w.shape()[transposed ? 0 : 1];
  const int64_t panels = (n + kPanel - 1) / kPanel, k2 = (k_dim + 1) / 2;
  const int64_t groups = (k_dim + kQuantGroup - 1) / kQuantGroup;
  paddle::Tensor out, scales;
  void* dst = nullptr;
  switch (format) {
    case LowpFormat::kBF16:
      out = paddle::empty({panels, k2, 2 * kPanel}, paddle::DataType::BFLOAT16, w.place());
      scales = paddle::empty({1}, paddle::DataType::FLOAT32, w.place());
      dst = out.data<phi::dtype::bfloat16>();
      break;
    case LowpFormat::kInt8:
      out = paddle::empty({panels, k_dim, kPanel}, paddle::DataType::INT8, w.place());
      scales = paddle::empty({panels * kPanel}, paddle::DataType::FLOAT32, w.place());
      dst = out.data<int8_t>();
      break;
    case LowpFormat::kInt4:
      out = paddle::empty({panels, k2, kPanel}, paddle::DataType::UINT8, w.place());
      scales = paddle::empty({panels, groups, kPanel}, paddle::DataType::FLOAT32, w.place());
      dst = out.data<uint8_t>();
      break;
  }
  prl_cpu::PackWeightLowp(w.data<float>(), format, dst, scales.data<float>(), k_dim, n, transposed);
  return {out, scales};
}

}  // namespace

std::vector<paddle::Tensor> PackWeightBF16(const paddle::Tensor& w, bool transposed) {
  return PackLowp(w, transposed, LowpFormat::kBF16, "prl_pack_weight_bf16");
}
std::vector<paddle::Tensor> PackWeightInt8(const paddle::Tensor& w, bool transposed) {
  return PackLowp(w, transposed, LowpFormat::kInt8, "prl_pack_weight_int8");
}
std::vector<paddle::Tensor> PackWeightInt4(const paddle::Tensor& w, bool transposed) {
  return PackLowp(w, transposed, LowpFormat::kInt4, "prl_pack_weight_int4");
}

std::vector<std::vector<int64_t>> PackWeightBF16InferShape(const std::vector<int64_t>& w, bool transposed) {
  const int64_t k_dim = w[transposed ? 1 : 0], n = w[transposed ? 0 : 1];
  return {{(n + kPanel - 1) / kPanel, (k_dim + 1) / 2, 2 * kPanel}, {1}};
}
std::vector<std::vector<int64_t>> PackWeightInt8InferShape(const std::vector<int64_t>& w, bool transposed) {
  const int64_t k_dim = w[transposed ? 1 : 0], panels = (w[transposed ? 0 : 1] + kPanel - 1) / kPanel;
  return {{panels, k_dim, kPanel}, {panels * kPanel}};
}
std::vector<std::vector<int64_t>> PackWeightInt4InferShape(const std::vector<int64_t>& w, bool transposed) {
  const int64_t k_dim = w[transposed ? 1 : 0], panels = (w[transposed ? 0 : 1] + kPanel - 1) / kPanel;
  return {{panels, (k_dim + 1) / 2, kPanel}, {panels, (k_dim + kQuantGroup - 1) / kQuantGroup, kPanel}};
}
std::vector<paddle::DataType> PackWeightBF16InferDtype(paddle::DataType) {
  return {paddle::DataType::BFLOAT16, paddle::DataType::FLOAT32};
}
std::vector<paddle::DataType> PackWeightInt8InferDtype(paddle::DataType) {
  return {paddle::DataType::INT8, paddle::DataType::FLOAT32};
}
std::vector<paddle::DataType> PackWeightInt4InferDtype(paddle::DataType) {
  return {paddle::DataType::UINT8, paddle::DataType::FLOAT32};
}

PD_BUILD_OP(prl_pack_weight_bf16)
    .Inputs({"W"})
    .Outputs({"Out", "Scales"})
    .Attrs({"transposed: bool"})
    .SetKernelFn(PD_KERNEL(PackWeightBF16))
    .SetInferShapeFn(PD_INFER_SHAPE(PackWeightBF16InferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PackWeightBF16InferDtype));

PD_BUILD_OP(prl_pack_weight_int8)
    .Inputs({"W"})
    .Outputs({"Out", "Scales"})
    .Attrs({"transposed: bool"})
    .SetKernelFn(PD_KERNEL(PackWeightInt8))
    .SetInferShapeFn(PD_INFER_SHAPE(PackWeightInt8InferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PackWeightInt8InferDtype));

PD_BUILD_OP(prl_pack_weight_int4)
    .Inputs({"W"})
    .Outputs({"Out", "Scales"})
    .Attrs({"transposed: bool"})
    .SetKernelFn(PD_KERNEL(PackWeightInt4))
    .SetInferShapeFn(PD_INFER_SHAPE(PackWeightInt4InferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PackWeightInt4InferDtype));

#ifdef PRL_WITH_CUDA
std::vector<paddle::Tensor> PackedLinearLowpCUDA(const paddle::Tensor& x, const paddle::Tensor& packed,
                                                 const paddle::Tensor& scales, int64_t n, bool bf16_act);
#endif

// x [..., K] float32 times a low-precision packed weight -> [..., n] float32; bf16_act rounds x to bfloat16 first.
// The shapes are checked here for both devices; x, packed and scales on the GPU run the CUDA kernel (the same
// packed bytes: a pack made here and copied to the GPU).
std::vector<paddle::Tensor> PackedLinearLowp(const paddle::Tensor& x, const paddle::Tensor& packed,
                                             const paddle::Tensor& scales, int64_t n, bool bf16_act) {
  const char* op = "prl_packed_linear_lowp";
  const LowpFormat format = FormatOf(packed, op);
  const auto& ps = packed.shape();
  const int64_t k_dim = prl::LastDim(x), rows = prl::Rows(x), k2 = (k_dim + 1) / 2;
  const int64_t panels = ps.size() == 3 ? ps[0] : 0;
  const int64_t groups = (k_dim + kQuantGroup - 1) / kQuantGroup;
  switch (format) {
    case LowpFormat::kBF16:
      PD_CHECK(ps.size() == 3 && ps[1] == k2 && ps[2] == 2 * kPanel, op, ": bfloat16 packed must be [P, ceil(K / 2), ",
               "64] with K = x's last dim (", k_dim, ")");
      PD_CHECK(bf16_act, op, ": bfloat16 weights multiply bfloat16 activations (bf16_act)");
      break;
    case LowpFormat::kInt8:
      PD_CHECK(ps.size() == 3 && ps[1] == k_dim && ps[2] == kPanel, op, ": int8 packed must be [P, K, 32] with K = ",
               "x's last dim (", k_dim, ")");
      PD_CHECK(scales.numel() == panels * kPanel, op, ": int8 scales must hold P * 32 values");
      break;
    case LowpFormat::kInt4:
      PD_CHECK(ps.size() == 3 && ps[1] == k2 && ps[2] == kPanel, op, ": int4 packed must be [P, ceil(K / 2), 32] ",
               "with K = x's last dim (", k_dim, ")");
      PD_CHECK(scales.numel() == panels * groups * kPanel, op, ": int4 scales must be [P, ceil(K / 128), 32]");
      break;
  }
  PD_CHECK(n >= 1 && n <= panels * kPanel && n > (panels - 1) * kPanel, op, ": n ", n, " does not match ", panels,
           " panels");
#ifdef PRL_WITH_CUDA
  if (x.is_gpu()) {
    PD_CHECK(x.dtype() == paddle::DataType::FLOAT32, op, ": x must be float32");
    PD_CHECK(scales.dtype() == paddle::DataType::FLOAT32, op, ": scales must be float32");
    PD_CHECK(packed.is_gpu() && scales.is_gpu(), op, ": x is on the GPU: packed and scales must be too (copy the ",
             "CPU pack there)");
    return PackedLinearLowpCUDA(x, packed, scales, n, bf16_act);
  }
#endif
  prl::CheckCpuFloat(x, op, "x");
  prl::CheckCpuFloat(scales, op, "scales");
  PD_CHECK(packed.is_cpu(), op, ": packed must be a CPU tensor");
  std::vector<int64_t> shape = x.shape();
  shape.back() = n;
  auto out = paddle::empty(shape, x.dtype(), x.place());
  const void* pw = format == LowpFormat::kBF16 ? static_cast<const void*>(packed.data<phi::dtype::bfloat16>())
                   : format == LowpFormat::kInt8 ? static_cast<const void*>(packed.data<int8_t>())
                                                 : static_cast<const void*>(packed.data<uint8_t>());
  prl_cpu::PackedLinearLowp(x.data<float>(), pw, scales.data<float>(), format, out.data<float>(), rows, k_dim, n,
                            bf16_act);
  return {out};
}

std::vector<std::vector<int64_t>> PackedLinearLowpInferShape(const std::vector<int64_t>& x,
                                                             const std::vector<int64_t>& packed,
                                                             const std::vector<int64_t>& scales, int64_t n,
                                                             bool bf16_act) {
  std::vector<int64_t> out = x;
  out.back() = n;
  return {out};
}

std::vector<paddle::DataType> PackedLinearLowpInferDtype(paddle::DataType x, paddle::DataType packed,
                                                         paddle::DataType scales) {
  return {x};
}

PD_BUILD_OP(prl_packed_linear_lowp)
    .Inputs({"X", "Packed", "Scales"})
    .Outputs({"Out"})
    .Attrs({"n: int64_t", "bf16_act: bool"})
    .SetKernelFn(PD_KERNEL(PackedLinearLowp))
    .SetInferShapeFn(PD_INFER_SHAPE(PackedLinearLowpInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PackedLinearLowpInferDtype));
#endif  // PRL_NO_PADDLE
