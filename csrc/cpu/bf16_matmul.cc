// C = op(A) op(B) with bfloat16 operands and float32 sums: the products of `bf16: true` training on a CPU (the
// linear layers' y = x W, dx = dy W^T, dW = x^T dy; paddle_rl/ops/linear.py, bf16_matmul).
//   A [M, K] (or [K, M] with trans_a), B [K, N] (or [N, K] with trans_b), C [M, N], all float32 row-major.
// Both operands are first rounded to bfloat16 (nearest even; a NaN becomes 0x7fff as Paddle's cast) and packed in
// pairs along K (a 32-bit word holds k = 2 kk in its low half, k = 2 kk + 1 in its high half), in blocks of 16
// rows of M (A) or 16 columns of N (B), K padded with zeros to a multiple of 32:
//   A: block [K / 32][16 rows][16 words]: 1 KB tiles, each an AMX tile of A (16 rows x 32 bfloat16)
//   B: block [K / 2 words][16 columns]: 16 pairs of it an AMX tile of B, a pair one zmm of vdpbf16ps's operand
// Two kernels multiply the packs; a bf16 x bf16 product is exact in float32, so both give the float32 sums of the
// exact products, in their own order (pairs summed in hardware, the pairs in k order per 16 x 16 tile / lane):
// - AMX (TDPBF16PS): C blocks of 32 x 32 in four tile registers, 16 k-pairs per step. Needs AMX-BF16 in cpuid,
//   the OS's tile state in XCR0 and the process's permission (arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA), asked
//   once); each thread loads the tile configuration before its part.
// - AVX512-BF16 (vdpbf16ps): 8 rows x 32 columns in 16 zmm accumulators, a k-pair per step.
// - AVX2 with FMA, on CPUs without a bfloat16 instruction: the packs' values widened to float32 (exact), then float32
//   FMA tiles of 6 rows x 16 columns in 12 ymm accumulators, k in order (Avx2Product).
// Both flush bfloat16 subnormal inputs and float32 subnormal results to zero (their hardware does; the reference
// does not): the only difference beyond the order of the sums, and only below 1.2e-38.
// The rollout's packed products (PackedLinearBF16Amx: bfloat16 weights; PackedLinearInt8Amx: int8 weights widened to
// bfloat16 on the way) run on the same AMX tiles; they are described at the end of this file.
// Packing: A row by row (each row's 16 pairs of a step written in place, 64 bytes), or pair by pair from two source
// rows (trans_a: 16 x 16 tiles transposed); B pair by pair reads its source rows in order, each column block's pair
// 64 bytes. A may be bfloat16 (to_bf16's copy, Paddle's cast bit for bit): its pairs are read as they are. The packs
// go to a grow-only buffer per thread (Workspace), so that their pages are not faulted in again on every call.
// Cache blocking: each thread takes a contiguous range of 32-column blocks (or of 32-row blocks when there are
// few columns); where its part of B fits in ~1.5 MB of L2, or a row pair of A in L1 (K <= 1024), the AMX kernel
// walks the row pairs over B panels of ~1 MB (C written row by row); else (a long K) it walks the rows in chunks
// whose packed A fits in ~1 MB, so a chunk of A is read from memory once per thread and each column block's B once
// per chunk. Each element's sum runs over k in one order whatever the split: the bits do not depend on the threads.
#include <sys/syscall.h>
#include <unistd.h>

#include <cpuid.h>
#include <memory>
#include <mutex>
#include <tuple>

#include "../prl_common.h"
#include "kernels.h"

namespace {

constexpr int64_t kRowBlock = 16;  // rows (A) or columns (B) per packed block
constexpr int64_t kPairStep = 16;  // k-pairs per AMX step: K is padded to 2 * 16
constexpr int64_t kChunkBytes = int64_t{1} << 20;  // packed A per row chunk, packed B per column panel (L2)
constexpr int64_t kPairInL1 = 64 << 10;             // a row pair of packed A that stays in L1 (48 KB) over a panel

inline int64_t RoundUp(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// v rounded to bfloat16 (nearest even; NaN -> 0x7fff) in the high half of a word, the low half zero
inline uint32_t Bf16High(float v) {
  const uint32_t u = prl::BitCast<uint32_t>(v);
  const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  return (u & 0x7fffffffu) > 0x7f800000u ? 0x7fff0000u : r;
}

inline uint32_t Pair(float even, float odd) { return Bf16High(odd) | (Bf16High(even) >> 16); }

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// An operand packed as above: rows padded to 16, k2p = K / 2 padded to 16 words
struct Packed {
  std::unique_ptr<uint32_t[], FreeDeleter> words;  // owned (null when data is the caller's)
  const uint32_t* data = nullptr;
  int64_t rows_p = 0, k2p = 0;
  const uint32_t* Block(int64_t rb) const { return data + rb * kRowBlock * k2p; }
};

// d[kk] = the pair (row[2 kk], row[2 kk + 1]) for kk < ceil(k / 2) (an odd k's last pair with a zero)
inline void RowPairs(const float* row, int64_t k, uint32_t* d) {
  int64_t kk = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  // vcvtne2ps2bf16 rounds to nearest even as Bf16High does, but flushes subnormal inputs to zero (the products'
  // hardware treats bfloat16 subnormals as zero anyway) and keeps a NaN's payload
  for (; 2 * kk + 32 <= k; kk += 16) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 2 * kk + 16), _mm512_loadu_ps(row + 2 * kk));
    _mm512_storeu_si512(d + kk, (__m512i)v);
  }
#endif
  for (; 2 * kk + 1 < k; ++kk) d[kk] = Pair(row[2 * kk], row[2 * kk + 1]);
  if (k % 2) d[kk] = Pair(row[k - 1], 0.0f);
}

// a bfloat16 row (the bits of Paddle's bfloat16): its pairs are its memory
inline void RowPairs(const uint16_t* row, int64_t k, uint32_t* d) {
  std::memcpy(d, row, k / 2 * sizeof(uint32_t));
  if (k % 2) d[k / 2] = row[k - 1];
}

// d[i] = the pair (even[i], odd[i]) for i < count (<= 16)
inline void InterleavePairs(const float* even, const float* odd, int64_t count, uint32_t* d) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (count == kRowBlock && odd) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(odd), _mm512_loadu_ps(even));
    _mm512_storeu_si512(d, _mm512_permutexvar_epi16(order, (__m512i)v));
    return;
  }
#endif
  for (int64_t i = 0; i < count; ++i) d[i] = Pair(even[i], odd ? odd[i] : 0.0f);
}

inline void InterleavePairs(const uint16_t* even, const uint16_t* odd, int64_t count, uint32_t* d) {
#if defined(__AVX512F__)
  if (count == kRowBlock && odd) {
    const __m512i e = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even)));
    const __m512i o = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd)));
    _mm512_storeu_si512(d, _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));
    return;
  }
#endif
  for (int64_t i = 0; i < count; ++i) d[i] = even[i] | (odd ? uint32_t{odd[i]} << 16 : 0u);
}

#if defined(__AVX512F__)
// dst[i * 16 + j] = src[j * 16 + i] for a 16 x 16 tile of words (dst 64-byte aligned): unpacks of 32- then 64-bit
// halves give each 128-bit lane 4 x 4 transposed, two 128-bit shuffles put the lanes in place
inline void Transpose16x16(const uint32_t* src, uint32_t* dst) {
  __m512i r[16], t[16];
  for (int j = 0; j < 16; ++j) r[j] = _mm512_load_si512(src + 16 * j);
  for (int j = 0; j < 16; j += 2) {
    t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
    t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
  }
  for (int j = 0; j < 16; j += 4) {  // r[j + q], lane L: column 4 L + q of source rows j .. j + 3
    r[j] = _mm512_unpacklo_epi64(t[j], t[j + 2]);
    r[j + 1] = _mm512_unpackhi_epi64(t[j], t[j + 2]);
    r[j + 2] = _mm512_unpacklo_epi64(t[j + 1], t[j + 3]);
    r[j + 3] = _mm512_unpackhi_epi64(t[j + 1], t[j + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    const __m512i v0 = _mm512_shuffle_i32x4(r[q], r[4 + q], 0x88), w0 = _mm512_shuffle_i32x4(r[q], r[4 + q], 0xDD);
    const __m512i v1 = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0xDD);
    _mm512_store_si512(dst + 16 * q, _mm512_shuffle_i32x4(v0, v1, 0x88));
    _mm512_store_si512(dst + 16 * (8 + q), _mm512_shuffle_i32x4(v0, v1, 0xDD));
    _mm512_store_si512(dst + 16 * (4 + q), _mm512_shuffle_i32x4(w0, w1, 0x88));
    _mm512_store_si512(dst + 16 * (12 + q), _mm512_shuffle_i32x4(w0, w1, 0xDD));
  }
}
#endif

// the word of row i < 16, pair kk of a block of A / B
inline int64_t AIndex(int64_t i, int64_t kk) { return ((kk >> 4) << 8) + (i << 4) + (kk & 15); }
inline int64_t BIndex(int64_t i, int64_t kk) { return kk * kRowBlock + i; }

// A grow-only buffer per calling thread and role (0: A's pack, 1: B's; 2, 3: the AVX2 kernel's widened A and B) that
// every product's packs reuse, so that
// their pages are not faulted in (and zeroed) again on each call (~2 us a 4 KB page here: a quarter of packing
// 25 MB); it keeps the largest pack asked for on that thread until the thread ends
uint32_t* Workspace(int role, int64_t words) {
  thread_local std::unique_ptr<uint32_t[], FreeDeleter> buffers[4];
  thread_local int64_t sizes[4] = {0, 0, 0, 0};
  if (sizes[role] < words) {
    buffers[role].reset();
    buffers[role].reset(static_cast<uint32_t*>(std::aligned_alloc(64, RoundUp(words * 4, 64))));
    sizes[role] = words;
  }
  return buffers[role].get();
}

// src element (r, k), r < rows, k < k: src[r * k + k] when k_contiguous, else src[k * rows + r]; a_layout: the
// blocks of A, else those of B. T: float (rounded here) or uint16_t (bfloat16 bits, taken as they are: a float32
// rounded by Bf16High gives the same pack as its bfloat16)
// dst: where to write (PackedWords(rows, k) words), else a buffer of its own
template <typename T>
Packed Pack(const T* src, int64_t rows, int64_t k, bool k_contiguous, bool a_layout, uint32_t* dst = nullptr) {
  Packed p;
  p.rows_p = RoundUp(rows, kRowBlock);
  p.k2p = RoundUp((k + 1) / 2, kPairStep);
  const int64_t k2p = p.k2p, k2 = (k + 1) / 2;
  if (!dst) {
    p.words.reset(static_cast<uint32_t*>(std::aligned_alloc(64, p.rows_p * k2p * sizeof(uint32_t))));
    dst = p.words.get();
  }
  p.data = dst;
  uint32_t* base = dst;
  const int64_t blocks = p.rows_p / kRowBlock;
  // zeros: the padding rows, and the pairs past K's
  for (int64_t rb = 0; rb < blocks; ++rb) {
    uint32_t* blk = base + rb * kRowBlock * k2p;
    const int64_t valid = std::min(kRowBlock, rows - rb * kRowBlock);
    for (int64_t i = 0; i < kRowBlock; ++i) {
      for (int64_t kk = i < valid ? k2 : 0; kk < k2p; ++kk) blk[a_layout ? AIndex(i, kk) : BIndex(i, kk)] = 0;
    }
  }
  if (k_contiguous) {  // row by row: each row's pairs are contiguous
    prl::ParallelFor(blocks, kRowBlock * k2p * 2, [&](int, int64_t begin, int64_t end) {
      std::vector<uint32_t> tmp(a_layout ? 0 : kRowBlock * k2p);
      for (int64_t rb = begin; rb < end; ++rb) {
        uint32_t* blk = base + rb * kRowBlock * k2p;
        const int64_t r0 = rb * kRowBlock, valid = std::min(kRowBlock, rows - r0);
        if (a_layout) {  // a row's 16 pairs of a step are one 64-byte row of its tile: written in place
          for (int64_t i = 0; i < valid; ++i) {
            for (int64_t kq = 0; kq < k2; kq += kPairStep) {
              RowPairs(src + (r0 + i) * k + 2 * kq, std::min(2 * kPairStep, k - 2 * kq), blk + AIndex(i, kq));
            }
          }
          continue;
        }
        for (int64_t i = 0; i < valid; ++i) RowPairs(src + (r0 + i) * k, k, tmp.data() + i * k2p);
        if (valid == kRowBlock) {
          for (int64_t kk = 0; kk < k2; ++kk) {
            for (int64_t i = 0; i < kRowBlock; ++i) blk[BIndex(i, kk)] = tmp[i * k2p + kk];
          }
        } else {
          for (int64_t kk = 0; kk < k2; ++kk) {
            for (int64_t i = 0; i < valid; ++i) blk[BIndex(i, kk)] = tmp[i * k2p + kk];
          }
        }
      }
    });
    return p;
  }
  if (!a_layout) {  // B pair by pair: source rows 2 kk and 2 kk + 1 read in order, each block's pair kk 64 bytes
    prl::ParallelFor(k2, rows * 2, [&](int, int64_t begin, int64_t end) {
      for (int64_t kk = begin; kk < end; ++kk) {
        const T* even = src + 2 * kk * rows;
        const T* odd = 2 * kk + 1 < k ? even + rows : nullptr;
        for (int64_t rb = 0; rb < blocks; ++rb) {
          const int64_t r0 = rb * kRowBlock;
          InterleavePairs(even + r0, odd ? odd + r0 : nullptr, std::min(kRowBlock, rows - r0),
                          base + rb * kRowBlock * k2p + kk * kRowBlock);
        }
      }
    });
    return p;
  }
  // A pair by pair: source rows 2 kk and 2 kk + 1 hold the pairs of all the rows; a 16-pair step (32 source rows,
  // read through) at a time over all the blocks, each block's 16 x 16 tile of pairs transposed; the threads split
  // the steps (20-35% faster than groups of blocks walking all of K, and balanced for few blocks)
  prl::ParallelFor((k2 + kPairStep - 1) / kPairStep, blocks * kRowBlock * kPairStep * 2, [&](int, int64_t begin,
                                                                                          int64_t end) {
    alignas(64) uint32_t tile[kPairStep][kRowBlock];
    for (int64_t q = begin; q < end; ++q) {
      const int64_t kq = q * kPairStep, pairs = std::min(kPairStep, k2 - kq);
      for (int64_t rb = 0; rb < blocks; ++rb) {
        uint32_t* blk = base + rb * kRowBlock * k2p;
        const int64_t r0 = rb * kRowBlock, valid = std::min(kRowBlock, rows - r0);
        for (int64_t j = 0; j < pairs; ++j) {
          const int64_t kk = kq + j;
          const T* even = src + 2 * kk * rows + r0;
          InterleavePairs(even, 2 * kk + 1 < k ? even + rows : nullptr, valid, tile[j]);
        }
#if defined(__AVX512F__)
        if (valid == kRowBlock && pairs == kPairStep) {  // the step's 16 x 16 words of the block: one tile
          Transpose16x16(&tile[0][0], blk + AIndex(0, kq));
          continue;
        }
#endif
        for (int64_t i = 0; i < valid; ++i) {
          for (int64_t j = 0; j < pairs; ++j) blk[AIndex(i, kq + j)] = tile[j][i];
        }
      }
    }
  });
  return p;
}

// ---- what the CPU and the OS allow
inline uint64_t Xcr0() {
  uint32_t a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0;  // OSXSAVE
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

bool Avx512Bf16Usable() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  static const bool ok = [] {
    uint32_t a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return false;
    return (Xcr0() & 0xe6) == 0xe6;  // SSE, AVX, opmask and both halves of the zmm state
  }();
  return ok;
#else
  return false;
#endif
}

bool AmxUsable() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  static const bool ok = [] {
    uint32_t a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    if ((Xcr0() & 0x60000) != 0x60000) return false;  // XTILECFG and XTILEDATA
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// A's rows per chunk, in blocks of 16 (an even count, at least 2): its packed rows fit kChunkBytes
inline int64_t ChunkBlocks(int64_t k2p) {
  const int64_t blocks = kChunkBytes / (kRowBlock * k2p * 4);
  return std::max<int64_t>(2, blocks / 2 * 2);
}

// fn(part, row_blocks [m_begin, m_end), column blocks [n_begin, n_end)) over the parts of the product, in
// 16-row / 16-column block units: the column blocks split in pairs over the threads, or the row blocks when the
// column pairs are fewer than the threads
template <typename Fn>
void OverParts(int64_t mb, int64_t nb, int64_t work_per_pair, Fn fn) {
  const int64_t col_pairs = (nb + 1) / 2, row_pairs = (mb + 1) / 2;
  if (col_pairs >= prl::NumThreads() || col_pairs >= row_pairs) {
    prl::ParallelFor(col_pairs, work_per_pair * row_pairs, [&](int part, int64_t b, int64_t e) {
      fn(part, int64_t{0}, mb, 2 * b, std::min(nb, 2 * e));
    });
  } else {
    prl::ParallelFor(row_pairs, work_per_pair * col_pairs, [&](int part, int64_t b, int64_t e) {
      fn(part, 2 * b, std::min(mb, 2 * e), int64_t{0}, nb);
    });
  }
}

// out[r, c] for r < rows, c < cols of a tile staged in buf (row stride ld floats)
inline void CopyOut(const float* buf, int64_t ld, float* c, int64_t ldc, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(c + r * ldc, buf + r * ld, cols * sizeof(float));
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: C (16 x 16 float32), 4-5: A (16 rows x 32 bfloat16), 6-7: B (16 k-pairs x 16 columns)
void AmxConfigure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// C[32 x 32] at (row block rb, column block cb) of the packs, both pairs of blocks present; `accumulate`: the sums
// start from out's values (C += A B) instead of zero
inline void AmxBlock2x2(const Packed& a, const Packed& b, int64_t rb, int64_t cb, float* out, int64_t ldo,
                        bool accumulate) {
  const uint32_t* a0 = a.Block(rb);
  const uint32_t* a1 = a.Block(rb + 1);
  const uint32_t* b0 = b.Block(cb);
  const uint32_t* b1 = b.Block(cb + 1);
  if (accumulate) {
    const int64_t so = ldo * 4;
    _tile_loadd(0, out, so);
    _tile_loadd(1, out + 16, so);
    _tile_loadd(2, out + 16 * ldo, so);
    _tile_loadd(3, out + 16 * ldo + 16, so);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kk = 0; kk < a.k2p; kk += kPairStep) {
    _tile_loadd(4, a0 + kk * kRowBlock, 64);
    _tile_loadd(6, b0 + kk * kRowBlock, 64);
    _tile_loadd(5, a1 + kk * kRowBlock, 64);
    _tile_loadd(7, b1 + kk * kRowBlock, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  const int64_t so = ldo * 4;
  _tile_stored(0, out, so);
  _tile_stored(1, out + 16, so);
  _tile_stored(2, out + 16 * ldo, so);
  _tile_stored(3, out + 16 * ldo + 16, so);
}

// C[16 x 16] at (rb, cb)
inline void AmxBlock1x1(const Packed& a, const Packed& b, int64_t rb, int64_t cb, float* out, int64_t ldo,
                        bool accumulate) {
  const uint32_t* a0 = a.Block(rb);
  const uint32_t* b0 = b.Block(cb);
  if (accumulate) {
    _tile_loadd(0, out, ldo * 4);
  } else {
    _tile_zero(0);
  }
  for (int64_t kk = 0; kk < a.k2p; kk += kPairStep) {
    _tile_loadd(4, a0 + kk * kRowBlock, 64);
    _tile_loadd(6, b0 + kk * kRowBlock, 64);
    _tile_dpbf16ps(0, 4, 6);
  }
  _tile_stored(0, out, ldo * 4);
}

// the part of C at (r, c) staged into buf (row stride ld), zeros around it: an accumulating tile's start
inline void CopyIn(const float* c, int64_t ldc, float* buf, int64_t ld, int64_t rows, int64_t cols, int64_t tile) {
  std::fill(buf, buf + tile * ld, 0.0f);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(buf + r * ld, c + r * ldc, cols * sizeof(float));
}

// C[32 x 32] (or its part in C) at row block pair rb, column block pair cb
inline void AmxPair(const Packed& a, const Packed& b, int64_t rb, int64_t cb, int64_t m_end, int64_t n_end, float* c,
                    int64_t m, int64_t n, float* stage, bool accumulate) {
  const int64_t row = rb * kRowBlock, col = cb * kRowBlock;
  const int64_t rows = std::min<int64_t>(32, m - row), cols = std::min<int64_t>(32, n - col);
  if (rb + 1 < m_end && cb + 1 < n_end) {
    if (rows == 32 && cols == 32) {
      AmxBlock2x2(a, b, rb, cb, c + row * n + col, n, accumulate);
    } else {
      if (accumulate) CopyIn(c + row * n + col, n, stage, 32, rows, cols, 32);
      AmxBlock2x2(a, b, rb, cb, stage, 32, accumulate);
      CopyOut(stage, 32, c + row * n + col, n, rows, cols);
    }
    return;
  }
  for (int64_t i = 0; i < 2 && rb + i < m_end; ++i) {  // a lone 16-row or 16-column block
    for (int64_t j = 0; j < 2 && cb + j < n_end; ++j) {
      const int64_t r = row + 16 * i, cc = col + 16 * j;
      const int64_t tr = std::min<int64_t>(16, m - r), tc = std::min<int64_t>(16, n - cc);
      if (accumulate) CopyIn(c + r * n + cc, n, stage, 16, tr, tc, 16);
      AmxBlock1x1(a, b, rb + i, cb + j, stage, 16, accumulate);
      CopyOut(stage, 16, c + r * n + cc, n, tr, tc);
    }
  }
}

// Where a part's B fits in L2 (its packs within 1.5 kChunkBytes; L2 is 2 MB a core here) or a row pair of A in L1
// (k <= 1024): B in panels of kChunkBytes, each panel's column pairs under every row pair (A's pair from L1, B's
// from L2; C written row by row, which its stores need: walking C down a column block by block runs at half the
// speed); else (a long k) chunks of A's rows in L2, the column pairs over each chunk
void AmxProduct(const Packed& a, const Packed& b, float* c, int64_t m, int64_t n, bool accumulate) {
  const int64_t mb = a.rows_p / kRowBlock, nb = b.rows_p / kRowBlock, chunk = ChunkBlocks(a.k2p);
  const int64_t block_bytes = kRowBlock * b.k2p * 4;
  OverParts(mb, nb, 32 * 32 * a.k2p, [&](int, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    AmxConfigure();
    alignas(64) float stage[32 * 32];
    const bool fits = (n1 - n0) * block_bytes <= kChunkBytes * 3 / 2;
    if (fits || 2 * block_bytes <= kPairInL1) {
      const int64_t panel = fits ? n1 - n0 : std::max<int64_t>(2, kChunkBytes / block_bytes / 2 * 2);
      for (int64_t p0 = n0; p0 < n1; p0 += panel) {
        const int64_t p1 = std::min(n1, p0 + panel);
        for (int64_t rb = m0; rb < m1; rb += 2) {
          for (int64_t cb = p0; cb < p1; cb += 2) AmxPair(a, b, rb, cb, m1, p1, c, m, n, stage, accumulate);
        }
      }
    } else {
      for (int64_t mc = m0; mc < m1; mc += chunk) {
        const int64_t mc_end = std::min(m1, mc + chunk);
        for (int64_t cb = n0; cb < n1; cb += 2) {
          for (int64_t rb = mc; rb < mc_end; rb += 2) {
            AmxPair(a, b, rb, cb, mc_end, n1, c, m, n, stage, accumulate);
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The rollout's bfloat16 product (PackedLinearBF16Amx): A the activations' pairs, zero-padded to 16-row blocks
// and 16-pair steps (row stride k2p words); B read in place from the rollout's packed panels, each k-pair row of a
// panel 32 columns x 2 bfloat16 = 128 bytes, so a tile of B is 16 such rows at stride 128 and its left or right
// 64 bytes. A panel's last partial step (k2 not a multiple of 16) is staged in 16 zero-padded rows.
constexpr int64_t kPanelCols = 32;

// C[16 r x 32] of a panel for r = 1 or 2 row blocks at row block rb: tiles 0-3 C, 4-5 A, 6-7 B
template <int R>
inline void AmxPanel(const uint32_t* a, int64_t k2p, int64_t rb, const uint16_t* panel, int64_t k2,
                     const uint16_t* tail, float* out, int64_t ldo) {
  const uint32_t* a0 = a + rb * kRowBlock * k2p;
  const uint32_t* a1 = a0 + kRowBlock * k2p;
  const int64_t sa = k2p * 4;
  _tile_zero(0);
  _tile_zero(1);
  if (R == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kk = 0; kk < k2p; kk += kPairStep) {
    const uint16_t* b = kk + kPairStep <= k2 ? panel + kk * 2 * kPanelCols : tail;
    _tile_loadd(4, a0 + kk, sa);
    _tile_loadd(6, b, 128);
    _tile_loadd(7, b + kPanelCols, 128);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (R == 2) {
      _tile_loadd(5, a1 + kk, sa);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int64_t so = ldo * 4;
  _tile_stored(0, out, so);
  _tile_stored(1, out + 16, so);
  if (R == 2) {
    _tile_stored(2, out + 16 * ldo, so);
    _tile_stored(3, out + 16 * ldo + 16, so);
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr int kAvxRows = 8;  // rows per vdpbf16ps tile: 8 x 2 accumulators

// C[rows x cols] (rows <= 8, cols <= 16 NT) from 8 rows of a block of A (a: its block + AIndex(first row, 0)) and NT
// column blocks of B
template <int NT>
inline void Avx512Tile(const uint32_t* a, const uint32_t* b0, const uint32_t* b1, int64_t k2, float* out, int64_t ldo,
                       int64_t rows, int64_t cols, bool accumulate) {
  __m512 acc[kAvxRows][NT];
  for (int r = 0; r < kAvxRows; ++r) {
    for (int j = 0; j < NT; ++j) {
      const int64_t c = std::max<int64_t>(0, std::min<int64_t>(16, cols - 16 * j));
      const __mmask16 mask = c == 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << c) - 1);
      acc[r][j] = accumulate && r < rows ? _mm512_maskz_loadu_ps(mask, out + r * ldo + 16 * j) : _mm512_setzero_ps();
    }
  }
  for (int64_t kk = 0; kk < k2; ++kk) {
    __m512bh w[NT];
    w[0] = (__m512bh)_mm512_loadu_si512(b0 + kk * kRowBlock);
    if constexpr (NT == 2) w[1] = (__m512bh)_mm512_loadu_si512(b1 + kk * kRowBlock);
    for (int r = 0; r < kAvxRows; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[AIndex(r, kk)]));
      for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], x, w[j]);
    }
  }
  for (int j = 0; j < NT; ++j) {
    const int64_t c = std::max<int64_t>(0, std::min<int64_t>(16, cols - 16 * j));
    const __mmask16 mask = c == 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << c) - 1);
    for (int64_t r = 0; r < rows; ++r) _mm512_mask_storeu_ps(out + r * ldo + 16 * j, mask, acc[r][j]);
  }
}

void Avx512Product(const Packed& a, const Packed& b, float* c, int64_t m, int64_t n, int64_t k, bool accumulate) {
  const int64_t mb = a.rows_p / kRowBlock, nb = b.rows_p / kRowBlock, chunk = ChunkBlocks(a.k2p);
  const int64_t k2 = (k + 1) / 2;  // the pairs that hold data (the rest of k2p is zeros)
  OverParts(mb, nb, 32 * 32 * a.k2p, [&](int, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    for (int64_t mc = m0; mc < m1; mc += chunk) {
      const int64_t row_end = std::min(m, std::min(m1, mc + chunk) * kRowBlock);
      for (int64_t cb = n0; cb < n1; cb += 2) {
        const int64_t col = cb * kRowBlock, cols = std::min<int64_t>(32, n - col);
        const uint32_t* b0 = b.Block(cb);
        for (int64_t row = mc * kRowBlock; row < row_end; row += kAvxRows) {
          const uint32_t* ap = a.Block(row / kRowBlock) + AIndex(row % kRowBlock, 0);
          const int64_t rows = std::min<int64_t>(kAvxRows, row_end - row);
          if (cb + 1 < n1) {
            Avx512Tile<2>(ap, b0, b.Block(cb + 1), k2, c + row * n + col, n, rows, cols, accumulate);
          } else {
            Avx512Tile<1>(ap, b0, b0, k2, c + row * n + col, n, rows, cols, accumulate);
          }
        }
      }
    }
  });
}
#endif

bool Avx2Usable() {
#if defined(__AVX2__) && defined(__FMA__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
// Without a bfloat16 instruction the values are widened: a bfloat16 is the high half of a float32, so a pair word w
// holds the float32s w << 16 (its even k) and w & 0xffff0000 (its odd k). Each thread widens a chunk of A's rows
// (kAvx2Rows rows x kAvx2Pairs pairs, ~192 KB for the L2 cache) into micro-panels of 6 rows, k-major (a k-step's 6
// values adjacent, one stream for the tile to broadcast from), and, per column block, that stretch of B (kAvx2Pairs
// x 2 k x 16 columns, 16 KB for the L1 cache), then runs float32 FMA tiles of 6 rows x 16 columns over them. A
// product of two bfloat16 values is exact in float32 and each sum takes k in order, the partial sums of one stretch
// of k kept in C (float32) for the next: the bits do not depend on the blocking or the threads.
constexpr int64_t kAvx2Pairs = 128, kAvx2Rows = 192;
constexpr int kAvx2TileRows = 6;

// the 16 words of A's row r (within its 16-row block) at pair step `step`, widened into k-steps 0 .. 31 of a
// micro-panel (out: the panel's first k-step of the step, then column rr of each k-step)
inline void WidenRowStep(const uint32_t* block, int64_t r, int64_t step, int64_t rr, float* out) {
  const uint32_t* w = block + (step << 8) + (r << 4);
  for (int j = 0; j < 16; ++j) {
    out[(2 * j) * kAvx2TileRows + rr] = prl::BitCast<float>(w[j] << 16);
    out[(2 * j + 1) * kAvx2TileRows + rr] = prl::BitCast<float>(w[j] & 0xffff0000u);
  }
}

// out[2 kk + e, 0 : 16) = column block b's pair kk widened (e = 0 even, 1 odd), kk in [0, pairs)
inline void WidenColumnBlock(const uint32_t* b, int64_t pairs, float* out) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t kk = 0; kk < pairs; ++kk) {
    for (int h = 0; h < 2; ++h) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + kk * kRowBlock + 8 * h));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * kk + 8 * h), _mm256_slli_epi32(w, 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * kk + 16 + 8 * h), _mm256_and_si256(w, high));
    }
  }
}

// C[MR x cols] (cols <= 16) = a micro-panel's first MR rows (x [kn][6]) times wb [kn, 16] over k < kn; `from_c`:
// the sums start from C. The accumulators stay in registers (12 + 2 weights + 1 broadcast of the 16 ymm registers
// at 6 rows).
template <int MR>
inline void Avx2Tile(const float* x, const float* wb, int64_t kn, float* out, int64_t ldo, int64_t cols, bool from_c) {
  prl::V8 acc[MR][2] = {};
  const bool whole = cols == 16;
  if (from_c) {
    for (int r = 0; r < MR; ++r) {
      float start[16] = {};
      const float* c = whole ? out + r * ldo : start;
      if (!whole) std::memcpy(start, out + r * ldo, cols * sizeof(float));
      acc[r][0] = prl::Load8(c);
      acc[r][1] = prl::Load8(c + 8);
    }
  }
  for (int64_t k = 0; k < kn; ++k) {
    const prl::V8 w0 = prl::Load8(wb + 16 * k), w1 = prl::Load8(wb + 16 * k + 8);
    for (int r = 0; r < MR; ++r) {
      const float xv = x[k * kAvx2TileRows + r];
      acc[r][0] += xv * w0;   // one FMA: the product of two bfloat16 values is exact, so the same bits as * then +
      acc[r][1] += xv * w1;
    }
  }
  for (int r = 0; r < MR; ++r) prl::StoreCols16(out + r * ldo, acc[r][0], acc[r][1], cols);
}

// rows [0, rows) of the widened chunk (micro-panels of ld k-steps x 6 rows: row r's panel at r / 6 * 6 ld) in tiles
// of 6 rows, the last rows < 6 in one tile of their size
inline void Avx2Rows(const float* x, int64_t ld, int64_t rows, const float* wb, int64_t kn, float* out, int64_t ldo,
                     int64_t cols, bool from_c) {
  int64_t r = 0;
  for (; r + kAvx2TileRows <= rows; r += kAvx2TileRows) {
    Avx2Tile<kAvx2TileRows>(x + r * ld, wb, kn, out + r * ldo, ldo, cols, from_c);
  }
  const float* xr = x + r * ld;
  float* o = out + r * ldo;
  switch (rows - r) {
    case 5: return Avx2Tile<5>(xr, wb, kn, o, ldo, cols, from_c);
    case 4: return Avx2Tile<4>(xr, wb, kn, o, ldo, cols, from_c);
    case 3: return Avx2Tile<3>(xr, wb, kn, o, ldo, cols, from_c);
    case 2: return Avx2Tile<2>(xr, wb, kn, o, ldo, cols, from_c);
    case 1: return Avx2Tile<1>(xr, wb, kn, o, ldo, cols, from_c);
    default: return;
  }
}

void Avx2Product(const Packed& a, const Packed& b, float* c, int64_t m, int64_t n, int64_t k, bool accumulate) {
  const int64_t mb = a.rows_p / kRowBlock, nb = b.rows_p / kRowBlock;
  const int64_t k2 = (k + 1) / 2;  // the pairs that hold data (the rest of k2p is zeros)
  OverParts(mb, nb, 32 * 32 * a.k2p, [&](int, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    float* xw = reinterpret_cast<float*>(Workspace(2, kAvx2Rows * 2 * kAvx2Pairs));
    float* wb = reinterpret_cast<float*>(Workspace(3, 2 * kAvx2Pairs * kRowBlock));
    const int64_t row_end = std::min(m, m1 * kRowBlock);
    for (int64_t row0 = m0 * kRowBlock; row0 < row_end; row0 += kAvx2Rows) {
      const int64_t rows = std::min(kAvx2Rows, row_end - row0);
      for (int64_t p0 = 0; p0 < k2; p0 += kAvx2Pairs) {
        const int64_t pairs = std::min(kAvx2Pairs, k2 - p0), steps = (pairs + 15) / 16;
        const int64_t ld = 32 * steps;   // k-steps per micro-panel: whole 16-pair steps (zeros past k2)
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t row = row0 + r;
          float* panel = xw + (r / kAvx2TileRows) * ld * kAvx2TileRows;
          for (int64_t s = 0; s < steps; ++s) {
            WidenRowStep(a.Block(row / kRowBlock), row % kRowBlock, p0 / 16 + s, r % kAvx2TileRows,
                         panel + 32 * s * kAvx2TileRows);
          }
        }
        for (int64_t cb = n0; cb < n1; ++cb) {
          const int64_t col = cb * kRowBlock, cols = std::min<int64_t>(kRowBlock, n - col);
          WidenColumnBlock(b.Block(cb) + p0 * kRowBlock, pairs, wb);
          Avx2Rows(xw, ld, rows, wb, 2 * pairs, c + row0 * n + col, n, cols, accumulate || p0 > 0);
        }
      }
    }
  });
}
#endif

}  // namespace

int prl_cpu::Bf16MatmulKernels() {
  return (AmxUsable() ? 1 : 0) | (Avx512Bf16Usable() ? 2 : 0) | (Avx2Usable() ? 4 : 0);
}

bool prl_cpu::Bf16Matmul(const void* a, bool a_bf16, const void* b, bool b_bf16, float* c, int64_t m, int64_t n,
                         int64_t k, bool trans_a, bool trans_b, Bf16Kernel kernel, bool accumulate) {
  Packed pb;  // an empty product reads no B (Bf16MatmulPacked answers it, and an unusable kernel, first)
  if (m > 0 && n > 0 && k > 0) {
    uint32_t* words = Workspace(1, Bf16PackedWords(n, k));
    pb = b_bf16 ? Pack(static_cast<const uint16_t*>(b), n, k, trans_b, false, words)
                : Pack(static_cast<const float*>(b), n, k, trans_b, false, words);
  }
  return Bf16MatmulPacked(a, a_bf16, pb.data, c, m, n, k, trans_a, kernel, accumulate);
}


int64_t prl_cpu::Bf16PackedWords(int64_t n, int64_t k) {
  return RoundUp(n, kRowBlock) * RoundUp((k + 1) / 2, kPairStep);
}

int64_t prl_cpu::Bf16PackB(const void* b, bool b_bf16, uint32_t* packed, int64_t n, int64_t k, bool trans_b) {
  if (b_bf16) {
    Pack(static_cast<const uint16_t*>(b), n, k, trans_b, false, packed);
  } else {
    Pack(static_cast<const float*>(b), n, k, trans_b, false, packed);
  }
  return Bf16PackedWords(n, k);
}

bool prl_cpu::Bf16MatmulPacked(const void* a, bool a_bf16, const uint32_t* packed_b, float* c, int64_t m, int64_t n,
                               int64_t k, bool trans_a, Bf16Kernel kernel, bool accumulate) {
  if (kernel == Bf16Kernel::kAuto) {
    kernel = AmxUsable() ? Bf16Kernel::kAmx : Avx512Bf16Usable() ? Bf16Kernel::kAvx512Bf16 : Bf16Kernel::kAvx2;
  }
  if ((kernel == Bf16Kernel::kAmx && !AmxUsable()) || (kernel == Bf16Kernel::kAvx512Bf16 && !Avx512Bf16Usable()) ||
      (kernel == Bf16Kernel::kAvx2 && !Avx2Usable())) {
    return false;
  }
  if (m == 0 || n == 0) return true;
  if (k == 0) {
    if (!accumulate) std::fill(c, c + m * n, 0.0f);
    return true;
  }
  uint32_t* a_words = Workspace(0, Bf16PackedWords(m, k));
  const Packed pa = a_bf16 ? Pack(static_cast<const uint16_t*>(a), m, k, !trans_a, true, a_words)
                           : Pack(static_cast<const float*>(a), m, k, !trans_a, true, a_words);
  Packed pb;
  pb.data = packed_b;
  pb.rows_p = RoundUp(n, kRowBlock);
  pb.k2p = RoundUp((k + 1) / 2, kPairStep);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (kernel == Bf16Kernel::kAmx) {
    AmxProduct(pa, pb, c, m, n, accumulate);
    return true;
  }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (kernel == Bf16Kernel::kAvx512Bf16) {
    Avx512Product(pa, pb, c, m, n, k, accumulate);
    return true;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (kernel == Bf16Kernel::kAvx2) {
    Avx2Product(pa, pb, c, m, n, k, accumulate);
    return true;
  }
#endif
  return false;
}

#ifndef PRL_NO_PADDLE
namespace {
// out[i] = x[i] rounded to bfloat16, nearest even, a NaN 0x7fff, subnormals kept: Paddle's cast, bit for bit
void ToBf16(const float* x, uint16_t* out, int64_t count) {
  constexpr int64_t kStep = 4096;
  prl::ParallelFor((count + kStep - 1) / kStep, kStep, [&](int, int64_t begin, int64_t end) {
    int64_t i = begin * kStep;
    const int64_t stop = std::min(count, end * kStep);
#if defined(__AVX512F__)
    // Bf16High's integers, 16 at a time: u + 0x7fff + (bit 16 of u), the high half; a NaN 0x7fff
    const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    for (; i + 16 <= stop; i += 16) {
      const __m512i u = _mm512_loadu_si512(x + i);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
      const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), odd), 16);
      const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r,
                                                                                                             bias)));
    }
#endif
    for (; i < stop; ++i) out[i] = static_cast<uint16_t>(Bf16High(x[i]) >> 16);
  });
}

// an operand's data and whether it is bfloat16: a float32 or bfloat16 CPU tensor
std::pair<const void*, bool> Bf16Operand(const paddle::Tensor& t, const char* op, const char* name) {
  if (t.dtype() == paddle::DataType::BFLOAT16) {
    PD_CHECK(t.is_cpu(), op, ": ", name, " must be a CPU tensor");
    return {t.data<phi::dtype::bfloat16>(), true};
  }
  prl::CheckCpuFloat(t, op, name);
  return {t.data<float>(), false};
}

void CheckKernelCode(int64_t kernel, const char* op) {
  PD_CHECK(kernel >= 0 && kernel <= 3, op, ": kernel must be 0 (auto), 1 (amx), 2 (avx512_bf16) or 3 (avx2), got ",
           kernel);
}

// `done`: whether the launcher ran the kernel asked for
void CheckKernelRan(bool done, int64_t kernel, const char* op) {
  const char* names[] = {"AMX-BF16, AVX512-BF16 and AVX2", "AMX-BF16", "AVX512-BF16", "AVX2"};
  PD_CHECK(done, op, ": the ", names[kernel], " kernel is not usable here (CPU, OS or build: see prl_bf16_kernels)");
}

// op(A) op(B)'s operands (float32 or bfloat16 CPU tensors, 2-D) and sizes, checked
struct Bf16Operands {
  const void* a;
  bool a_bf16;
  const void* b;
  bool b_bf16;
  int64_t m, n, k;

  Bf16Operands(const paddle::Tensor& ta, const paddle::Tensor& tb, bool trans_a, bool trans_b, int64_t kernel,
               const char* op) {
    std::tie(a, a_bf16) = Bf16Operand(ta, op, "a (float32 or bfloat16)");
    std::tie(b, b_bf16) = Bf16Operand(tb, op, "b (float32 or bfloat16)");
    PD_CHECK(ta.shape().size() == 2 && tb.shape().size() == 2, op, ": a and b must be 2-D");
    CheckKernelCode(kernel, op);
    m = ta.shape()[trans_a ? 1 : 0];
    k = ta.shape()[trans_a ? 0 : 1];
    const int64_t kb = tb.shape()[trans_b ? 1 : 0];
    n = tb.shape()[trans_b ? 0 : 1];
    PD_CHECK(k == kb, op, ": inner dimensions differ (a gives ", k, ", b gives ", kb, ")");
  }
};
}  // namespace

// A [M, K] (or [K, M] with trans_a), B [K, N] (or [N, K] with trans_b), each float32 or bfloat16 -> C [M, N]
// float32; kernel: 0 the best the CPU has, 1 AMX, 2 AVX512-BF16 (an error where it is not usable)
std::vector<paddle::Tensor> Bf16MatmulOp(const paddle::Tensor& a, const paddle::Tensor& b, bool trans_a, bool trans_b,
                                         int64_t kernel) {
  const char* op = "prl_bf16_matmul";
  const Bf16Operands x(a, b, trans_a, trans_b, kernel, op);
  auto out = paddle::empty({x.m, x.n}, paddle::DataType::FLOAT32, a.place());
  CheckKernelRan(prl_cpu::Bf16Matmul(x.a, x.a_bf16, x.b, x.b_bf16, out.data<float>(), x.m, x.n, x.k, trans_a,
                                     trans_b, static_cast<prl_cpu::Bf16Kernel>(kernel)),
                 kernel, op);
  return {out};
}

std::vector<std::vector<int64_t>> Bf16MatmulInferShape(const std::vector<int64_t>& a, const std::vector<int64_t>& b,
                                                       bool trans_a, bool trans_b, int64_t kernel) {
  return {{a[trans_a ? 1 : 0], b[trans_b ? 0 : 1]}};
}

std::vector<paddle::DataType> Bf16MatmulInferDtype(paddle::DataType a, paddle::DataType b) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(prl_bf16_matmul)
    .Inputs({"A", "B"})
    .Outputs({"Out"})
    .Attrs({"trans_a: bool", "trans_b: bool", "kernel: int64_t"})
    .SetKernelFn(PD_KERNEL(Bf16MatmulOp))
    .SetInferShapeFn(PD_INFER_SHAPE(Bf16MatmulInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Bf16MatmulInferDtype));

// C [M, N] float32 += op(A) op(B) (prl_bf16_matmul's operands and numbers, the sums starting from C's values): a sum
// of products without a new [M, N] tensor per term (the LM head's weight gradient over its chunks)
void Bf16MatmulAccumulateOp(paddle::Tensor& c, const paddle::Tensor& a, const paddle::Tensor& b, bool trans_a,
                            bool trans_b, int64_t kernel) {
  const char* op = "prl_bf16_matmul_accumulate";
  const Bf16Operands x(a, b, trans_a, trans_b, kernel, op);
  prl::CheckCpuFloat(c, op, "c");
  PD_CHECK(c.shape().size() == 2 && c.shape()[0] == x.m && c.shape()[1] == x.n, op, ": c must be [", x.m, ", ", x.n,
           "]");
  CheckKernelRan(prl_cpu::Bf16Matmul(x.a, x.a_bf16, x.b, x.b_bf16, c.data<float>(), x.m, x.n, x.k, trans_a, trans_b,
                                     static_cast<prl_cpu::Bf16Kernel>(kernel), true),
                 kernel, op);
}

std::vector<std::vector<int64_t>> Bf16MatmulAccumulateInferShape(const std::vector<int64_t>& c,
                                                                 const std::vector<int64_t>& a,
                                                                 const std::vector<int64_t>& b, bool trans_a,
                                                                 bool trans_b, int64_t kernel) {
  return {c};
}

std::vector<paddle::DataType> Bf16MatmulAccumulateInferDtype(paddle::DataType c, paddle::DataType a,
                                                             paddle::DataType b) {
  return {c};
}

PD_BUILD_OP(prl_bf16_matmul_accumulate)
    .Inputs({"C", "A", "B"})
    .Outputs({"COut"})
    .Attrs({"trans_a: bool", "trans_b: bool", "kernel: int64_t"})
    .SetInplaceMap({{"C", "COut"}})
    .SetKernelFn(PD_KERNEL(Bf16MatmulAccumulateOp))
    .SetInferShapeFn(PD_INFER_SHAPE(Bf16MatmulAccumulateInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Bf16MatmulAccumulateInferDtype));

// B [K, N] (or [N, K] with trans_b) float32 or bfloat16 -> its pack for prl_bf16_matmul_packed: [N padded to 16,
// K / 2 padded to 16] int32 words (pairs of bfloat16, the layout above): a weight packed once and multiplied many
// times
std::vector<paddle::Tensor> Bf16PackBOp(const paddle::Tensor& b, bool trans_b) {
  const char* op = "prl_bf16_pack_b";
  const auto [b_data, b_bf16] = Bf16Operand(b, op, "b (float32 or bfloat16)");
  PD_CHECK(b.shape().size() == 2, op, ": b must be 2-D");
  const int64_t k = b.shape()[trans_b ? 1 : 0], n = b.shape()[trans_b ? 0 : 1];
  auto out = paddle::empty({RoundUp(n, kRowBlock), RoundUp((k + 1) / 2, kPairStep)}, paddle::DataType::INT32,
                           b.place());
  prl_cpu::Bf16PackB(b_data, b_bf16, reinterpret_cast<uint32_t*>(out.data<int32_t>()), n, k, trans_b);
  return {out};
}

std::vector<std::vector<int64_t>> Bf16PackBInferShape(const std::vector<int64_t>& b, bool trans_b) {
  const int64_t k = b[trans_b ? 1 : 0], n = b[trans_b ? 0 : 1];
  return {{RoundUp(n, kRowBlock), RoundUp((k + 1) / 2, kPairStep)}};
}

std::vector<paddle::DataType> Bf16PackBInferDtype(paddle::DataType b) { return {paddle::DataType::INT32}; }

PD_BUILD_OP(prl_bf16_pack_b)
    .Inputs({"B"})
    .Outputs({"Out"})
    .Attrs({"trans_b: bool"})
    .SetKernelFn(PD_KERNEL(Bf16PackBOp))
    .SetInferShapeFn(PD_INFER_SHAPE(Bf16PackBInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Bf16PackBInferDtype));

// op(A) times a B packed by prl_bf16_pack_b (n its columns): prl_bf16_matmul's numbers, B packed once
std::vector<paddle::Tensor> Bf16MatmulPackedOp(const paddle::Tensor& a, const paddle::Tensor& packed_b, bool trans_a,
                                               int64_t n, int64_t kernel) {
  const char* op = "prl_bf16_matmul_packed";
  const auto [a_data, a_bf16] = Bf16Operand(a, op, "a (float32 or bfloat16)");
  PD_CHECK(a.shape().size() == 2, op, ": a must be 2-D");
  PD_CHECK(packed_b.dtype() == paddle::DataType::INT32 && packed_b.shape().size() == 2 && packed_b.is_cpu(), op,
           ": packed_b must be prl_bf16_pack_b's int32 [N16, K2] CPU tensor");
  CheckKernelCode(kernel, op);
  const int64_t m = a.shape()[trans_a ? 1 : 0], k = a.shape()[trans_a ? 0 : 1];
  PD_CHECK(packed_b.shape()[0] == RoundUp(n, kRowBlock) && packed_b.shape()[1] == RoundUp((k + 1) / 2, kPairStep), op,
           ": packed_b [", packed_b.shape()[0], ", ", packed_b.shape()[1], "] is not the pack of a [", k, ", ", n,
           "] operand");
  auto out = paddle::empty({m, n}, paddle::DataType::FLOAT32, a.place());
  CheckKernelRan(prl_cpu::Bf16MatmulPacked(a_data, a_bf16, reinterpret_cast<const uint32_t*>(packed_b.data<int32_t>()),
                                           out.data<float>(), m, n, k, trans_a,
                                           static_cast<prl_cpu::Bf16Kernel>(kernel)),
                 kernel, op);
  return {out};
}

std::vector<std::vector<int64_t>> Bf16MatmulPackedInferShape(const std::vector<int64_t>& a,
                                                             const std::vector<int64_t>& packed_b, bool trans_a,
                                                             int64_t n, int64_t kernel) {
  return {{a[trans_a ? 1 : 0], n}};
}

std::vector<paddle::DataType> Bf16MatmulPackedInferDtype(paddle::DataType a, paddle::DataType b) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(prl_bf16_matmul_packed)
    .Inputs({"A", "PackedB"})
    .Outputs({"Out"})
    .Attrs({"trans_a: bool", "n: int64_t", "kernel: int64_t"})
    .SetKernelFn(PD_KERNEL(Bf16MatmulPackedOp))
    .SetInferShapeFn(PD_INFER_SHAPE(Bf16MatmulPackedInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Bf16MatmulPackedInferDtype));

// x float32 -> x rounded to bfloat16 (Paddle's cast's bits: nearest even, a NaN 0x7fff), in parallel
std::vector<paddle::Tensor> ToBf16Op(const paddle::Tensor& x) {
  prl::CheckCpuFloat(x, "prl_to_bf16", "x");
  auto out = paddle::empty(x.shape(), paddle::DataType::BFLOAT16, x.place());
  ToBf16(x.data<float>(), reinterpret_cast<uint16_t*>(out.data<phi::dtype::bfloat16>()), x.numel());
  return {out};
}

std::vector<std::vector<int64_t>> ToBf16InferShape(const std::vector<int64_t>& x) { return {x}; }

std::vector<paddle::DataType> ToBf16InferDtype(paddle::DataType x) { return {paddle::DataType::BFLOAT16}; }

PD_BUILD_OP(prl_to_bf16)
    .Inputs({"X"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(ToBf16Op))
    .SetInferShapeFn(PD_INFER_SHAPE(ToBf16InferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(ToBf16InferDtype));

// [3] int32: whether the AMX-BF16, the AVX512-BF16 and the AVX2 kernels are usable (CPU, OS and build); x is not
// read
std::vector<paddle::Tensor> Bf16KernelsOp(const paddle::Tensor& x) {
  auto out = paddle::empty({3}, paddle::DataType::INT32, paddle::CPUPlace());
  const int kernels = prl_cpu::Bf16MatmulKernels();
  for (int i = 0; i < 3; ++i) out.data<int32_t>()[i] = (kernels >> i) & 1;
  return {out};
}

std::vector<std::vector<int64_t>> Bf16KernelsInferShape(const std::vector<int64_t>& x) { return {{3}}; }

std::vector<paddle::DataType> Bf16KernelsInferDtype(paddle::DataType x) { return {paddle::DataType::INT32}; }

PD_BUILD_OP(prl_bf16_kernels)
    .Inputs({"X"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(Bf16KernelsOp))
    .SetInferShapeFn(PD_INFER_SHAPE(Bf16KernelsInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(Bf16KernelsInferDtype));
#endif

bool prl_cpu::PackedLinearBF16Amx(const uint32_t* xp, const uint16_t* packed, float* out, int64_t rows, int64_t k2,
                                  int64_t n) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (!AmxUsable()) return false;
  const int64_t k2p = RoundUp(k2, kPairStep), rows_p = RoundUp(rows, kRowBlock), blocks = rows_p / kRowBlock;
  const int64_t panels = (n + kPanelCols - 1) / kPanelCols;
  std::unique_ptr<uint32_t[], FreeDeleter> a(static_cast<uint32_t*>(std::aligned_alloc(64, rows_p * k2p * 4)));
  std::memset(a.get(), 0, rows_p * k2p * 4);
  for (int64_t m = 0; m < rows; ++m) std::memcpy(a.get() + m * k2p, xp + m * k2, k2 * 4);
  const int64_t tail_kk = k2 / kPairStep * kPairStep;  // the first pair of a partial last step
  prl::ParallelFor(panels, rows_p * k2p * 2 * kPanelCols, [&](int, int64_t begin, int64_t end) {
    AmxConfigure();
    alignas(64) float stage[32 * 32];
    alignas(64) uint16_t tail[kPairStep * 2 * kPanelCols];
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* panel = packed + p * k2 * 2 * kPanelCols;
      if (tail_kk < k2) {
        std::memset(tail, 0, sizeof(tail));
        std::memcpy(tail, panel + tail_kk * 2 * kPanelCols, (k2 - tail_kk) * 2 * kPanelCols * 2);
      }
      const int64_t col = p * kPanelCols, cols = std::min(kPanelCols, n - col);
      for (int64_t rb = 0; rb < blocks; rb += 2) {
        const int64_t row = rb * kRowBlock, r = std::min<int64_t>(2 * kRowBlock, rows - row);
        const bool pair = rb + 1 < blocks, direct = cols == kPanelCols && r == (pair ? 32 : 16);
        float* dst = direct ? out + row * n + col : stage;
        const int64_t ld = direct ? n : 32;
        if (pair) {
          AmxPanel<2>(a.get(), k2p, rb, panel, k2, tail, dst, ld);
        } else {
          AmxPanel<1>(a.get(), k2p, rb, panel, k2, tail, dst, ld);
        }
        if (!direct) CopyOut(stage, 32, out + row * n + col, n, r, cols);
      }
    }
    _tile_release();
  });
  return true;
#else
  (void)xp, (void)packed, (void)out, (void)rows, (void)k2, (void)n;
  return false;
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {

// v rounded to bfloat16 (nearest even; a NaN stays a NaN), as float32
inline __m512 RoundToBF16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v), high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x00400000));
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_mask_blend_epi32(nan, r, quiet), high));
}

// dst part p (p < parts), k2p words from dst + p * part_words: row x [k_dim] as `parts` bfloat16 terms in pairs
// (k = 2 kk in a word's low half), zero past k_dim: part 0 x rounded to nearest even, part 1 the remainder
// x - part 0 (exact in float32) rounded, part 2 what is left of that. Three parts hold x exactly: the first 8 or 9
// significant bits, the next 8, the rest (fewer than 8: each remainder is at most half a unit of the last part's
// last bit); the tiles flush a part below 2^-126 to zero (|x| < ~2^-110).
inline void SplitRow(const float* x, int64_t k_dim, int parts, int64_t k2p, int64_t part_words, uint32_t* dst) {
  int64_t k = 0;
  for (; k + 32 <= k_dim; k += 32) {
    __m512 v0 = _mm512_loadu_ps(x + k), v1 = _mm512_loadu_ps(x + k + 16);
    for (int p = 0; p < parts; ++p) {
      const __m512 h0 = RoundToBF16(v0), h1 = RoundToBF16(v1);
      // h0, h1 are bfloat16 values: the conversion is exact, its pairs in k order
      _mm512_storeu_si512(dst + p * part_words + k / 2, (__m512i)_mm512_cvtne2ps_pbh(h1, h0));
      v0 = _mm512_sub_ps(v0, h0);
      v1 = _mm512_sub_ps(v1, h1);
    }
  }
  for (int64_t kk = k / 2; kk < k2p; ++kk) {  // the last pairs, and zeros to k2p
    float v[2] = {2 * kk < k_dim ? x[2 * kk] : 0.0f, 2 * kk + 1 < k_dim ? x[2 * kk + 1] : 0.0f};
    for (int p = 0; p < parts; ++p) {
      uint32_t h[2];
      for (int e = 0; e < 2; ++e) {
        const uint32_t u = prl::BitCast<uint32_t>(v[e]);
        h[e] = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) & 0xffff0000u
                                                : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
        v[e] -= prl::BitCast<float>(h[e]);
      }
      dst[p * part_words + kk] = h[1] | (h[0] >> 16);
    }
  }
}

// dst [16 k-pairs][32 columns x 2] bfloat16 (two AMX tiles of B at stride 128 bytes, as a bfloat16 panel's rows):
// the int8 panel's rows 2 kk and 2 kk + 1 for kk in [kk0, kk0 + 16), rows at or past k_dim zero. An int8 value
// widened to float32 has at most 8 significant bits: its float32's high half is its bfloat16, exactly.
inline void Int8StepToBF16(const int8_t* panel, int64_t k_dim, int64_t kk0, uint32_t* dst) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const auto row = [&](int64_t k, int half) {
    if (k >= k_dim) return _mm512_setzero_si512();
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + k * kPanelCols + 16 * half));
    return _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
  };
  for (int64_t j = 0; j < kPairStep; ++j) {
    const int64_t k = 2 * (kk0 + j);
    for (int half = 0; half < 2; ++half) {
      const __m512i even = row(k, half), odd = row(k + 1, half);
      // (odd & 0xffff0000) | (even >> 16): the odd k's bfloat16 in the high half, the even k's in the low
      const __m512i w = _mm512_ternarylogic_epi32(odd, high, _mm512_srli_epi32(even, 16), 0xEA);
      _mm512_store_si512(dst + j * kPanelCols + 16 * half, w);
    }
  }
}

// out[16 x 32] (ldo floats a row) = the sums of one 16-row block of A over an int8 panel: a [parts][16][k2p] words
// (part stride part_words), b(kk) the 16-pair step's 2 KB of bfloat16 weights. Two accumulators per 16 columns,
// the even steps (0-1) and the odd ones (2-3), each taking a step's parts in turn (two chains of tile products, so
// that one waits less on the other's latency), added at the end: the same order whatever the other rows are.
template <typename StepB>
inline void AmxInt8Block(const uint32_t* a, int64_t part_words, int parts, int64_t k2p, StepB&& b, float* out,
                         int64_t ldo) {
  const int64_t sa = k2p * 4;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kk = 0; kk < k2p; kk += 2 * kPairStep) {
    const uint32_t* w = b(kk);
    _tile_loadd(6, w, 128);
    _tile_loadd(7, w + 16, 128);
    for (int part = 0; part < parts; ++part) {
      _tile_loadd(4, a + part * part_words + kk, sa);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (kk + kPairStep < k2p) {
      const uint32_t* w2 = b(kk + kPairStep);
      _tile_loadd(6, w2, 128);
      _tile_loadd(7, w2 + 16, 128);
      for (int part = 0; part < parts; ++part) {
        _tile_loadd(5, a + part * part_words + kk + kPairStep, sa);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
  }
  alignas(64) float odd[16 * 32];
  const int64_t so = ldo * 4;
  _tile_stored(0, out, so);
  _tile_stored(1, out + 16, so);
  _tile_stored(2, odd, 128);
  _tile_stored(3, odd + 16, 128);
  for (int64_t i = 0; i < 16; ++i) {
    for (int h = 0; h < 2; ++h) {
      float* o = out + i * ldo + 16 * h;
      _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_load_ps(odd + i * 32 + 16 * h)));
    }
  }
}

}  // namespace
#endif

// The rollout's int8-weight product (weight_only_int8): each panel's int8 weights widened to bfloat16 a 32-row
// step at a time (one 16-row block: into a 2 KB buffer in L1; more: the whole panel once, then every block reads
// it), the activations' bfloat16 parts in 16-row blocks, TDPBF16PS. The products are exact (8-bit integers times
// bfloat16), so the error is the float32 sums' alone: a chain sums at most 3 K / 2 + 48 terms, then one add and
// the scale's multiply, |y - exact| <= (3 K / 2 + 50) u s_j sum_k |x_k q_kj| to first order (u = 2^-24), measured
// <= 0.8 u (the AVX-512 tile's FMAs: up to 4.2 u); bfloat16 subnormal parts and float32 subnormal sums flush to
// zero, as in the bfloat16 product.
bool prl_cpu::PackedLinearInt8Amx(const float* xs, int parts, const int8_t* packed, const float* scales, float* out,
                                  int64_t rows, int64_t k_dim, int64_t n) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (!AmxUsable()) return false;
  const int64_t k2 = (k_dim + 1) / 2, k2p = RoundUp(k2, kPairStep), rows_p = RoundUp(rows, kRowBlock);
  const int64_t blocks = rows_p / kRowBlock, panels = (n + kPanelCols - 1) / kPanelCols, part_words = kRowBlock * k2p;
  // the activations' parts, by 16-row block: [block][part][16 rows][k2p words], padding rows zero
  const int64_t block_words = parts * part_words;
  std::unique_ptr<uint32_t[], FreeDeleter> a(static_cast<uint32_t*>(std::aligned_alloc(64, blocks * block_words * 4)));
  if (rows < rows_p) std::memset(a.get() + (blocks - 1) * block_words, 0, block_words * 4);
  for (int64_t m = 0; m < rows; ++m) {
    SplitRow(xs + m * k_dim, k_dim, parts, k2p, part_words,
             a.get() + (m / kRowBlock) * block_words + (m % kRowBlock) * k2p);
  }
  // one row block: each step's weights converted once, into L1; more: the whole panel converted once per panel
  const bool whole = blocks > 1;
  prl::ParallelFor(panels, rows_p * k2p * 2 * kPanelCols * parts, [&](int, int64_t begin, int64_t end) {
    AmxConfigure();
    alignas(64) float stage[16 * 32];
    alignas(64) uint32_t step[kPairStep * kPanelCols];
    std::unique_ptr<uint32_t[], FreeDeleter> conv;
    if (whole) conv.reset(static_cast<uint32_t*>(std::aligned_alloc(64, k2p * kPanelCols * 4)));
    for (int64_t p = begin; p < end; ++p) {
      const int8_t* panel = packed + p * k_dim * kPanelCols;
      if (whole) {
        for (int64_t kk = 0; kk < k2p; kk += kPairStep) Int8StepToBF16(panel, k_dim, kk, conv.get() + kk * kPanelCols);
      }
      const auto b = [&](int64_t kk) -> const uint32_t* {
        if (whole) return conv.get() + kk * kPanelCols;
        Int8StepToBF16(panel, k_dim, kk, step);
        return step;
      };
      const int64_t col = p * kPanelCols, cols = std::min(kPanelCols, n - col);
      const __m512 s0 = _mm512_loadu_ps(scales + col), s1 = _mm512_loadu_ps(scales + col + 16);
      const __mmask16 lo = static_cast<__mmask16>(cols >= 16 ? 0xffff : (1u << cols) - 1);
      const __mmask16 hi = static_cast<__mmask16>(cols >= 32 ? 0xffff : cols <= 16 ? 0 : (1u << (cols - 16)) - 1);
      for (int64_t rb = 0; rb < blocks; ++rb) {
        AmxInt8Block(a.get() + rb * block_words, part_words, parts, k2p, b, stage, 32);
        const int64_t row = rb * kRowBlock, r = std::min<int64_t>(kRowBlock, rows - row);
        for (int64_t i = 0; i < r; ++i) {  // y = s_j * the column's sum, once
          float* o = out + (row + i) * n + col;
          _mm512_mask_storeu_ps(o, lo, _mm512_mul_ps(_mm512_load_ps(stage + 32 * i), s0));
          _mm512_mask_storeu_ps(o + 16, hi, _mm512_mul_ps(_mm512_load_ps(stage + 32 * i + 16), s1));
        }
      }
    }
    _tile_release();
  });
  return true;
#else
  (void)xs, (void)parts, (void)packed, (void)scales, (void)out, (void)rows, (void)k_dim, (void)n;
  return false;
#endif
}
