// Grouped-query attention on the CPU: one decode step against the preallocated KV cache, and a packed row's
// training / prefill attention with its backward.
// Decode: q [B, 1, H, D] float32; cache_k, cache_v [B, KV, C, D] float32, bfloat16 or float16 (read as float32);
//   start [B] int64: row b attends to slots start[b] .. length - 1
//   (its left padding is skipped); out [B, 1, H * D]. Query head h reads kv head h / (H / KV).
// Packed (models/packing.py): q [N, H, D], k, v [N, KV, D] float32 of one row of N tokens holding several
//   sequences; spans [N, 4] int64 give each token's keys as two ranges (its prompt, then its own segment up to
//   itself) and the queries of each key as one range (cpu/kernels.h). The forward keeps out and each row's
//   log-sum-exp; the backward recomputes the probabilities from them in one pass over blocks of keys
//   (FlashAttention-2's order: d v, d k of the block and its share of d q from each chunk of the queries that read
//   it). The row falls into regions closed under attention (a shared prompt with its responses), one thread each
//   (with a kv head), whose key blocks run in order: each gradient row is one thread's sum in a fixed order, so the
//   results do not depend on the number of threads.
#include <array>
#include <algorithm>
#include <type_traits>
#include <utility>

#include "../prl_common.h"
#include "kernels.h"

namespace {

constexpr int64_t kHeadBlock = 4;  // query heads of a group that share each load (and conversion) of a key or value

// Ask for the cache lines of one row of d elements.
template <typename T>
inline void Prefetch(const T* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < d * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off, 0, 3);
}

// Vector accumulators a block keeps in registers: 32 vector registers with AVX-512, else 16, less the loaded rows
// (a key block's NK, q read from memory) or the loaded row and its broadcast weight (a value tile's NV + 1).
#ifdef __AVX512F__
constexpr int kScoreAccumulators = 24, kValueAccumulators = 24;
#else
constexpr int kScoreAccumulators = 12, kValueAccumulators = 8;
#endif

// Keys scored together by a block of M heads: M x NK independent dot products (the loads of a key row serve M
// heads, and no product waits on the one before it), reduced NK at a time.
template <int M>
constexpr int KeyBlock() {
  return M * 8 <= kScoreAccumulators ? 8 : M * 4 <= kScoreAccumulators ? 4 : 2;
}

// out[j * stride + i] = scale * (q_j . k_i) for the M query heads of a block (q: M rows of d floats) and NK keys
// (k: NK rows of d elements); d % 8 == 0.
template <int M, int NK, typename T>
inline void Score(const float* q, const T* k, int64_t d, float scale, float* out, int64_t stride) {
  prl::V8 a[M][NK] = {};
  for (int64_t c = 0; c < d; c += 8) {
    prl::V8 x[NK];
    for (int i = 0; i < NK; ++i) x[i] = prl::Load8(k + i * d + c);
    for (int j = 0; j < M; ++j) {
      const prl::V8 y = prl::Load8(q + j * d + c);
      for (int i = 0; i < NK; ++i) a[j][i] += y * x[i];
    }
  }
  for (int j = 0; j < M; ++j) prl::HSums<NK>(a[j], scale, out + j * stride);
}

// The value (or key) rows of a window: slot s of it (counted from the window's first slot) is row s of `shared` for
// s < `ns` (the same prompt's rows in the cache of the row that shares them with this one: the same numbers, read
// from memory once for all the rows of a prompt), else row s of `own`.
template <typename T>
struct Rows {
  const T* own;
  const T* shared;
  int64_t ns;
  int64_t d;
  const T* At(int64_t s) const { return (s < ns ? shared : own) + s * d; }
  Rows Offset(int64_t c) const { return Rows{own + c, shared + c, ns, d}; }
  // The window's n slots as two runs in order: slots bound[r] .. bound[r + 1] - 1 are rows of base[r] (the shared
  // ones, then the own). Loops over them are plain loops (a lambda per run could keep a tile's accumulators out of
  // the registers).
  struct Split {
    const T* base[2];
    int64_t bound[3];
  };
  Split Runs(int64_t n) const {
    const int64_t split = std::min(ns, n);
    return Split{{shared, own}, {0, split, n}};
  }
};

// The rows of the next window to fetch while this one is read: rows from..n - 1 of `rows` (its shared rows are
// not fetched: the row that owns them reads them first, and they stay in the cache for the others).
template <typename T>
struct Fetch {
  const T* rows;
  int64_t from, n;
  // always inlined: GCC takes a function whose only effect is a prefetch for one without effects, and drops calls
  // to it that it has not inlined yet (no prefetch would be left)
  __attribute__((always_inline)) void At(int64_t s, int64_t d) const {
    if (s >= from && s < n) Prefetch(rows + s * d, d);
  }
};

// acc_j[0 : 8 NV] = sum_s p[j * stride + s] * v_s[0 : 8 NV] over a window's n slots for the M heads of a block
// (v: the window's rows, offset to the tile's first column; acc: M rows of d floats, offset alike). The M x NV
// accumulators stay in registers over all the slots; fetches the next window's rows along.
template <int M, int NV, typename T>
inline void AccumulateTile(const Rows<T>& v, const float* p, int64_t stride, int64_t d, int64_t n, float* acc,
                           const Fetch<T>& next) {
  prl::V8 a[M][NV] = {};
  const auto runs = v.Runs(n);
  for (int r = 0; r < 2; ++r) {
    const T* base = runs.base[r];
    for (int64_t s = runs.bound[r]; s < runs.bound[r + 1]; ++s) {
      next.At(s, d);
      prl::V8 x[NV];
      for (int i = 0; i < NV; ++i) x[i] = prl::Load8(base + s * d + 8 * i);
      for (int j = 0; j < M; ++j) {
        const float w = p[j * stride + s];
        for (int i = 0; i < NV; ++i) a[j][i] += w * x[i];
      }
    }
  }
  for (int j = 0; j < M; ++j) std::memcpy(acc + j * d, a[j], sizeof(a[j]));
}

// The same over whole rows for any d % 8 == 0, the accumulators in memory (L1): each value row is read once, in
// order, which keeps a window too wide for the registers streaming at the memory's rate.
template <int M, typename T>
inline void AccumulateInMemory(const Rows<T>& v, const float* p, int64_t stride, int64_t d, int64_t n, float* acc,
                               const Fetch<T>& next) {
  std::fill(acc, acc + M * d, 0.0f);
  const auto runs = v.Runs(n);
  for (int run = 0; run < 2; ++run) {
    const T* base = runs.base[run];
    for (int64_t s = runs.bound[run]; s < runs.bound[run + 1]; ++s) {
      next.At(s, d);
      for (int64_t c = 0; c < d; c += 8) {
        const prl::V8 x = prl::Load8(base + s * d + c);
        for (int j = 0; j < M; ++j) {
          const prl::V8 r = prl::Load8(acc + j * d + c) + p[j * stride + s] * x;
          std::memcpy(acc + j * d + c, &r, sizeof(r));
        }
      }
    }
  }
}

// A window whose value rows fit in the L2 cache (at most kTiledBytes) is passed once per column tile.
constexpr int64_t kTiledBytes = 256 << 10;

template <int M, typename T>
inline void Accumulate(const Rows<T>& v, const float* p, int64_t stride, int64_t d, int64_t n, float* acc,
                       const Fetch<T>& next) {
  // a whole row in one tile where its accumulators fit in the registers
  if constexpr (M * 8 <= kValueAccumulators) {
    if (d == 64) return AccumulateTile<M, 8>(v, p, stride, d, n, acc, next);
  }
  if constexpr (M * 4 <= kValueAccumulators) {
    if (d == 32) return AccumulateTile<M, 4>(v, p, stride, d, n, acc, next);
  }
  constexpr int NV = M * 4 <= kValueAccumulators ? 4 : 2;
  if (d % (8 * NV) != 0 || n * d * static_cast<int64_t>(sizeof(T)) > kTiledBytes) {
    return AccumulateInMemory<M>(v, p, stride, d, n, acc, next);
  }
  const Fetch<T> none{next.rows, 0, 0};
  for (int64_t c = 0; c < d; c += 8 * NV) {
    AccumulateTile<M, NV>(v.Offset(c), p, stride, d, n, acc + c, c == 0 ? next : none);
  }
}

// Any head_dim: one element at a time.
template <int M, typename T>
inline void ScoreScalar(const float* q, const T* k, int64_t d, float scale, float* out, int64_t stride) {
  for (int j = 0; j < M; ++j) {
    float dot = 0.0f;
    for (int64_t i = 0; i < d; ++i) dot += q[j * d + i] * prl::ToFloat(k[i]);
    out[j * stride] = dot * scale;
  }
}

template <int M, typename T>
inline void AccumulateScalar(const Rows<T>& v, const float* p, int64_t stride, int64_t d, int64_t n, float* acc) {
  std::fill(acc, acc + M * d, 0.0f);
  for (int64_t s = 0; s < n; ++s) {
    const T* row = v.At(s);
    for (int64_t i = 0; i < d; ++i) {
      const float x = prl::ToFloat(row[i]);
      for (int j = 0; j < M; ++j) acc[j * d + i] += p[j * stride + s] * x;
    }
  }
}

// fn.template operator()<M>() for the size M of the head block starting at j0
template <typename Fn>
inline void ForBlock(int64_t groups, int64_t j0, Fn&& fn) {
  switch (std::min(kHeadBlock, groups - j0)) {
    case 4: return fn(std::integral_constant<int, 4>());
    case 3: return fn(std::integral_constant<int, 3>());
    case 2: return fn(std::integral_constant<int, 2>());
    default: return fn(std::integral_constant<int, 1>());
  }
}

// The (row, kv head) items [begin, end); T: the cache's element type. shared [B, 2] (or null): row b's first
// shared[b][1] slots are the same numbers as those of row shared[b][0]'s (the same prompt, fanned out to its
// samples), and are read from there (the result is the same bits; the rows of a prompt come one after another, so
// the shared rows are still in the cache after the first of them read them from memory).
template <typename T>
void Attend(const float* qp, const T* kp, const T* vp, const int64_t* st, const int64_t* shared, float* out,
            int64_t begin, int64_t end, int64_t heads, int64_t kv, int64_t cap, int64_t d, int64_t length,
            float scale) {
  const int64_t groups = heads / kv;
  const bool wide = d % 8 == 0;
  std::vector<float> scores(static_cast<size_t>(groups) * cap), acc(static_cast<size_t>(groups) * d), inv(groups);
  struct Window {
    int64_t at, n;       // its first slot's offset in the caches, its number of slots
    int64_t shared_at;   // the offset of the same slot in the cache of the row it shares its first ns slots with
    int64_t ns;
  };
  // the window of item (row, kv head): slots are counted from the row's first one, so a row's result does not
  // depend on where its window sits in the cache or on the rows beside it
  auto window = [&](int64_t item) {
    const int64_t bi = item / kv, g = item % kv;
    const int64_t first = std::min<int64_t>(std::max<int64_t>(st[bi], 0), length - 1);
    const int64_t at = ((bi * kv + g) * cap + first) * d, n = length - first;
    const int64_t src = shared != nullptr ? shared[2 * bi] : bi;
    if (src == bi) return Window{at, n, at, 0};
    const int64_t ns = std::clamp<int64_t>(shared[2 * bi + 1] - first, 0, n);
    return Window{at, n, ((src * kv + g) * cap + first) * d, ns};
  };
  for (int64_t item = begin; item < end; ++item) {
    const int64_t bi = item / kv, g = item % kv;
    const Window w = window(item);
    const int64_t n = w.n;
    const Rows<T> keys{kp + w.at, kp + w.shared_at, w.ns, d};
    const Rows<T> values{vp + w.at, vp + w.shared_at, w.ns, d};
    const float* q0 = qp + (bi * heads + g * groups) * d;  // the group's query heads are adjacent
    // the next item's window is a new stream: fetch its own rows while this item's are read
    const Window nw = item + 1 < end ? window(item + 1) : Window{0, 0, 0, 0};
    const Fetch<T> next_keys{kp + nw.at, nw.ns, nw.n};
    const Fetch<T> next_values{vp + nw.at, nw.ns, nw.n};
    for (int64_t j0 = 0; j0 < groups; j0 += kHeadBlock) {
      ForBlock(groups, j0, [&](auto m) {
        constexpr int M = decltype(m)::value;
        constexpr int NK = KeyBlock<M>();
        const float* q = q0 + j0 * d;
        float* o = scores.data() + j0 * cap;
        int64_t s = 0;
        if (wide) {
          // blocks of keys wholly among the shared rows read them there, the others (one may straddle) their own
          const auto runs = keys.Runs(n);
          for (int r = 0; r < 2; ++r) {
            for (; s + NK <= runs.bound[r + 1]; s += NK) {
              if (j0 == 0) {
                for (int64_t i = s; i < s + NK; ++i) next_keys.At(i, d);
              }
              Score<M, NK>(q, runs.base[r] + s * d, d, scale, o + s, cap);
            }
          }
          for (; s < n; ++s) Score<M, 1>(q, keys.At(s), d, scale, o + s, cap);
        } else {
          for (; s < n; ++s) ScoreScalar<M>(q, keys.At(s), d, scale, o + s, cap);
        }
      });
    }
    for (int64_t j = 0; j < groups; ++j) {
      float* sc = scores.data() + j * cap;
      float mx = -3.0e38f;
#pragma omp simd reduction(max : mx)
      for (int64_t s = 0; s < n; ++s) mx = std::max(mx, sc[s]);
      inv[j] = 1.0f / prl::ExpShiftSum(sc, mx, n);
    }
    const Fetch<T> none{vp, 0, 0};
    for (int64_t j0 = 0; j0 < groups; j0 += kHeadBlock) {
      ForBlock(groups, j0, [&](auto m) {
        constexpr int M = decltype(m)::value;
        const float* p = scores.data() + j0 * cap;
        if (wide) Accumulate<M>(values, p, cap, d, n, acc.data() + j0 * d, j0 == 0 ? next_values : none);
        else AccumulateScalar<M>(values, p, cap, d, n, acc.data() + j0 * d);
      });
    }
    for (int64_t j = 0; j < groups; ++j) {
      float* o = out + (bi * heads + g * groups + j) * d;
      for (int64_t i = 0; i < d; ++i) o[i] = acc[j * d + i] * inv[j];
    }
  }
}

}  // namespace

// The packed attention's launchers (CPU only: no CUDA counterpart, so not in kernels.h, whose launchers the
// standalone CUDA check compares one by one).
namespace prl_cpu {
// Attention of a packed row (several sequences in one row of n tokens): q [n, heads, d], k, v [n, kv, d] float32
// (query head h reads kv head h / (heads / kv)); spans [n, 4] int64 per token t: (prefix_begin, prefix_end,
// segment_begin, query_end): t attends to keys [prefix_begin, prefix_end) and [segment_begin, t]; the queries that
// attend to key t are exactly [t, query_end). out [n, heads, d]; lse [n, heads] (the log-sum-exp of each row's
// scaled scores, what the backward recomputes the probabilities from).
void PackedAttentionForward(const float* q, const float* k, const float* v, const int64_t* spans, float* out,
                            float* lse, int64_t n, int64_t heads, int64_t kv, int64_t d, float scale);
// dq [n, heads, d], dk, dv [n, kv, d] from d out (grad) and the forward's out and lse.
void PackedAttentionBackward(const float* q, const float* k, const float* v, const int64_t* spans, const float* out,
                             const float* lse, const float* grad, float* dq, float* dk, float* dv, int64_t n,
                             int64_t heads, int64_t kv, int64_t d, float scale);
}  // namespace prl_cpu

namespace {

// ---- packed attention: per block of queries (forward) or keys (backward) and kv head, the scores as a small
// product of (query, head) rows against the block's keys gathered into transposed panels (DotTile), then the
// weighted sums of rows (MixTile, or MixTTile with the weights transposed); head_dim % 16 == 0 (the Python side
// keeps other sizes on the reference)
constexpr int64_t kBlock = 16;       // queries per block (forward)
constexpr int64_t kKeyBlock = 64;    // keys per block at most (backward)
constexpr int64_t kQueryChunk = 32;  // backward: queries per chunk of a key block's queries

// 16 floats: one register with AVX-512. Without it, two 8-float halves: a 64-byte vector of the compiler's own
// would be split element by element through the stack (measured 1.8 GFLOP/s for this kernel on an AVX2 EPYC), while
// the halves stay in ymm registers. The tiles below keep their accumulators within the ISA's registers (kWideTiles).
#ifdef __AVX512F__
typedef float V16 __attribute__((vector_size(64)));
constexpr bool kWideTiles = true;  // 32 zmm registers: DotTile's 32-column tiles, MixTile's 4 x 64 columns

inline V16 Ld16(const float* p) {
  V16 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline void St16(float* p, V16 x) { std::memcpy(p, &x, sizeof(x)); }
#else
struct V16 {
  prl::V8 lo = {}, hi = {};
};
constexpr bool kWideTiles = false;  // 16 ymm registers: 16-column dot tiles, 16-column mix tiles

inline V16 operator+(V16 a, V16 b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline V16 operator*(float x, V16 a) { return {x * a.lo, x * a.hi}; }
inline V16 operator*(V16 a, float x) { return {a.lo * x, a.hi * x}; }
inline V16& operator+=(V16& a, V16 b) { return a = a + b; }
inline V16 Ld16(const float* p) { return {prl::Load8(p), prl::Load8(p + 8)}; }
inline void St16(float* p, V16 x) {
  prl::Store8(p, x.lo);
  prl::Store8(p + 8, x.hi);
}
#endif

inline int64_t Pad16(int64_t v) { return (v + 15) / 16 * 16; }

// Transposed operands are kept in panels of 16 columns: column c, element k at (c / 16) * 16 d + 16 k + c % 16, so
// a panel's rows are consecutive cache lines.
// s[r * lds + c] = scale * sum_k a[r][k] bt(k, c) for r < R, c < cols (cols % 16 == 0), bt the panel of column 0
template <int R>
inline void DotTile(const float* const* a, const float* bt, int64_t d, int64_t cols, float scale, float* s,
                    int64_t lds) {
  const int64_t panel = 16 * d;
  int64_t c = 0;
  if constexpr (kWideTiles) {
    for (; c + 32 <= cols; c += 32) {
      V16 acc[R][2] = {};
      const float* p0 = bt + (c / 16) * panel;
      for (int64_t k = 0; k < d; ++k) {
        const V16 b0 = Ld16(p0 + 16 * k), b1 = Ld16(p0 + panel + 16 * k);
        for (int r = 0; r < R; ++r) {
          const float x = a[r][k];
          acc[r][0] += x * b0;
          acc[r][1] += x * b1;
        }
      }
      for (int r = 0; r < R; ++r) {
        St16(s + r * lds + c, acc[r][0] * scale);
        St16(s + r * lds + c + 16, acc[r][1] * scale);
      }
    }
  }
  for (; c < cols; c += 16) {
    V16 acc[R] = {};
    const float* p0 = bt + (c / 16) * panel;
    for (int64_t k = 0; k < d; ++k) {
      const V16 b0 = Ld16(p0 + 16 * k);
      for (int r = 0; r < R; ++r) acc[r] += a[r][k] * b0;
    }
    for (int r = 0; r < R; ++r) St16(s + r * lds + c, acc[r] * scale);
  }
}

// o[r][0 : d] (+)= scale * sum_c w[r * ldw + c] x[c][0 : d] for r < R, c < n (d % 16 == 0)
template <int R, int NV>
inline void MixTile(const float* w, int64_t ldw, const float* const* x, int64_t n, int64_t d, float scale,
                    float* const* o, bool add) {
  for (int64_t c0 = 0; c0 < d; c0 += 16 * NV) {
    V16 acc[R][NV] = {};
    for (int64_t c = 0; c < n; ++c) {
      V16 xv[NV];
      for (int v = 0; v < NV; ++v) xv[v] = Ld16(x[c] + c0 + 16 * v);
      for (int r = 0; r < R; ++r) {
        const float ww = w[r * ldw + c];
        for (int v = 0; v < NV; ++v) acc[r][v] += ww * xv[v];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < NV; ++v) {
        float* dst = o[r] + c0 + 16 * v;
        St16(dst, add ? Ld16(dst) + acc[r][v] * scale : acc[r][v] * scale);
      }
    }
  }
}

// the R-row tiles of `rows` rows, R = 4 but for the last
template <typename Fn>
inline void OverRowTiles(int64_t rows, Fn&& fn) {
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    switch (std::min<int64_t>(4, rows - r0)) {
      case 4: fn(r0, std::integral_constant<int, 4>()); break;
      case 3: fn(r0, std::integral_constant<int, 3>()); break;
      case 2: fn(r0, std::integral_constant<int, 2>()); break;
      default: fn(r0, std::integral_constant<int, 1>()); break;
    }
  }
}

// S [rows, cols] = scale * a bt (a: row pointers, bt: panels from column 0)
inline void Dot(const float* const* a, int64_t rows, const float* bt, int64_t d, int64_t cols, float scale, float* s,
                int64_t lds) {
  OverRowTiles(rows, [&](int64_t r0, auto r) {
    DotTile<decltype(r)::value>(a + r0, bt, d, cols, scale, s + r0 * lds, lds);
  });
}

// column c of transposed panels of 16 columns (the layout above) set to x[0 : d]
inline void SetPanelColumn(float* panels, int64_t c, const float* x, int64_t d) {
  float* dst = panels + (c / 16) * 16 * d + c % 16;
  for (int64_t i = 0; i < d; ++i) dst[16 * i] = x[i];
}

// o rows (+)= scale * w x (w [rows, ldw], x: n row pointers)
inline void Mix(const float* w, int64_t ldw, int64_t rows, const float* const* x, int64_t n, int64_t d, float scale,
                float* const* o, bool add) {
  OverRowTiles(rows, [&](int64_t r0, auto r) {
    constexpr int R = decltype(r)::value;
    if constexpr (kWideTiles) {
      if (d % 64 == 0) return MixTile<R, 4>(w + r0 * ldw, ldw, x, n, d, scale, o + r0, add);
    }
    MixTile<R, 1>(w + r0 * ldw, ldw, x, n, d, scale, o + r0, add);
  });
}

// o[c][0 : d] += sum_r w[r * ldw + c] x[r][0 : d] for c < R (o rows of d floats; d % 16 == 0): the transposed
// weights' Mix, a block of keys' gradient summed over the query rows that read it
template <int R>
inline void MixTTile(const float* w, int64_t ldw, const float* const* x, int64_t rows, int64_t d, float* o) {
  for (int64_t c0 = 0; c0 < d; c0 += 16) {
    V16 acc[R] = {};
    for (int64_t r = 0; r < rows; ++r) {
      const V16 xv = Ld16(x[r] + c0);
      const float* wr = w + r * ldw;
      for (int i = 0; i < R; ++i) acc[i] += wr[i] * xv;
    }
    for (int i = 0; i < R; ++i) St16(o + i * d + c0, Ld16(o + i * d + c0) + acc[i]);
  }
}

// o [cols, d] += w^T x: w [rows, ldw] (its first `cols` columns), x: rows row pointers
inline void MixT(const float* w, int64_t ldw, int64_t rows, const float* const* x, int64_t cols, int64_t d, float* o) {
  OverRowTiles(cols, [&](int64_t c0, auto r) {
    MixTTile<decltype(r)::value>(w + c0, ldw, x, rows, d, o + c0 * d);
  });
}

// The token's keys: its prefix [begin0, end0) and its own segment up to itself [begin1, t]
struct KeyRanges {
  int64_t begin[2], end[2];
  int64_t Count() const { return (end[0] - begin[0]) + (end[1] - begin[1]); }
};

inline KeyRanges KeysOf(const int64_t* spans, int64_t t) {
  const int64_t* sp = spans + 4 * t;
  return {{sp[0], sp[2]}, {sp[1], t + 1}};
}

// Blocks of up to most(first token) consecutive tokens that share `same(a, b)`; returns their starts and n
template <typename Most, typename Same>
std::vector<int64_t> TokenBlocks(int64_t n, Most most, Same same) {
  std::vector<int64_t> starts;
  for (int64_t j = 0; j < n;) {
    starts.push_back(j);
    int64_t e = j + 1;
    const int64_t width = most(j);
    while (e < n && e - j < width && same(j, e)) ++e;
    j = e;
  }
  starts.push_back(n);
  return starts;
}

// [0, items) split into at most NumThreads() contiguous parts of about equal cost; returns the parts' bounds
template <typename Cost>
std::vector<int64_t> CostParts(int64_t items, Cost cost) {
  std::vector<int64_t> prefix(items + 1, 0);
  for (int64_t i = 0; i < items; ++i) prefix[i + 1] = prefix[i] + cost(i);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(prl::NumThreads(), items));
  std::vector<int64_t> bounds{0};
  for (int64_t p = 1; p < parts; ++p) {
    const int64_t at = std::lower_bound(prefix.begin(), prefix.end(), prefix[items] * p / parts) - prefix.begin();
    if (at > bounds.back() && at < items) bounds.push_back(at);
  }
  bounds.push_back(items);
  return bounds;
}

// fn(first item, end) over the parts, one thread each (the parts depend on the costs, the results do not)
template <typename Fn>
void OverCostParts(const std::vector<int64_t>& bounds, int64_t work, Fn fn) {
  const int64_t parts = static_cast<int64_t>(bounds.size()) - 1;
  prl::ParallelFor(parts, work / std::max<int64_t>(1, parts), [&](int, int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) fn(bounds[p], bounds[p + 1]);
  });
}

// The row's regions [bounds[i], bounds[i + 1]): spans of tokens closed under attention (every key's queries and
// every query's keys inside one region; a shared prompt with its responses, or one sequence)
std::vector<int64_t> Regions(const int64_t* spans, int64_t n) {
  std::vector<int64_t> bounds{0};
  int64_t reach = 0;   // the end of the queries of the keys so far
  for (int64_t t = 0; t < n; ++t) {
    if (t > bounds.back() && t >= reach) bounds.push_back(t);
    reach = std::max(reach, spans[4 * t + 3]);
  }
  bounds.push_back(n);
  return bounds;
}

}  // namespace

void prl_cpu::PackedAttentionForward(const float* q, const float* k, const float* v, const int64_t* spans, float* out,
                                     float* lse, int64_t n, int64_t heads, int64_t kv, int64_t d, float scale) {
  const int64_t groups = heads / kv;
  // query blocks: up to kBlock consecutive tokens with the same keys but for their own (prefix, segment start)
  const auto blocks = TokenBlocks(n, [](int64_t) { return kBlock; }, [&](int64_t a, int64_t b) {
    return spans[4 * a] == spans[4 * b] && spans[4 * a + 1] == spans[4 * b + 1] && spans[4 * a + 2] == spans[4 * b + 2];
  });
  const int64_t nb = static_cast<int64_t>(blocks.size()) - 1;
  const auto parts = CostParts(nb * kv, [&](int64_t item) {
    const int64_t b = item / kv, t = blocks[b + 1] - 1;
    return (blocks[b + 1] - blocks[b]) * KeysOf(spans, t).Count() + 1;
  });
  const std::vector<float> zero(d, 0.0f);
  OverCostParts(parts, n * heads * d * 64, [&](int64_t begin, int64_t end) {
    std::vector<float> s, panel;
    std::vector<const float*> arow(kBlock * groups), x;
    std::vector<float*> orow(kBlock * groups);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv, g = item % kv, t0 = blocks[b], t1 = blocks[b + 1];
      // the block's keys (its last token's: the prefix, then the segment up to it) as transposed panels of 16
      // columns, the columns past them zero; x their value rows
      const KeyRanges r = KeysOf(spans, t1 - 1);
      const int64_t prefix = r.end[0] - r.begin[0], count = r.Count(), cols = Pad16(count), rows = (t1 - t0) * groups;
      panel.resize(cols * d);
      x.resize(cols);
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t key = c < prefix ? r.begin[0] + c : r.begin[1] + c - prefix;
        const float* kc = c < count ? k + (key * kv + g) * d : zero.data();
        x[c] = c < count ? v + (key * kv + g) * d : zero.data();
        SetPanelColumn(panel.data(), c, kc, d);
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t h = (t0 + i / groups) * heads + g * groups + i % groups;
        arow[i] = q + h * d;
        orow[i] = out + h * d;
      }
      s.resize(rows * cols);
      Dot(arow.data(), rows, panel.data(), d, cols, scale, s.data(), cols);
      for (int64_t i = 0; i < rows; ++i) {
        // query t reads the prefix and its segment up to itself: the row's first `seen` columns
        const int64_t seen = prefix + (t0 + i / groups) - r.begin[1] + 1;
        float* row = s.data() + i * cols;
        float mx = -3.0e38f;
#pragma omp simd reduction(max : mx)
        for (int64_t c = 0; c < seen; ++c) mx = std::max(mx, row[c]);
        const float sum = prl::ExpShiftSum(row, mx, seen), inv = 1.0f / sum;
#pragma omp simd
        for (int64_t c = 0; c < seen; ++c) row[c] *= inv;
        std::fill(row + seen, row + cols, 0.0f);
        lse[(t0 + i / groups) * heads + g * groups + i % groups] = mx + std::log(sum);
      }
      Mix(s.data(), cols, rows, x.data(), count, d, 1.0f, orow.data(), false);
    }
  });
}

void prl_cpu::PackedAttentionBackward(const float* q, const float* k, const float* v, const int64_t* spans,
                                      const float* out, const float* lse, const float* grad, float* dq, float* dk,
                                      float* dv, int64_t n, int64_t heads, int64_t kv, int64_t d, float scale) {
  const int64_t groups = heads / kv;
  // delta = d out . out per (token, head)
  std::vector<float> delta(n * heads);
  prl::ParallelFor(n * heads, d, [&](int, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) delta[i] = prl::Dot(grad + i * d, out + i * d, d);
  });
  const auto regions = Regions(spans, n);
  // a key block's queries are read once per block: the keys that many queries read go in wider blocks (fewer
  // passes over those queries; measured on a 300-token prompt shared by 8 responses: 1.9x for 64 over 16), the
  // others in blocks of 16 (less of the block past the queries' own positions: 16 fastest on 34-token responses)
  const auto kblocks = TokenBlocks(n, [&](int64_t j) {
    const int64_t readers = spans[4 * j + 3] - j;
    return readers >= 512 ? kKeyBlock : readers >= 192 ? kKeyBlock / 2 : kKeyBlock / 4;
  }, [&](int64_t a, int64_t b) {
    return spans[4 * a + 2] == spans[4 * b + 2] && spans[4 * a + 3] == spans[4 * b + 3];
  });
  const int64_t nr = static_cast<int64_t>(regions.size()) - 1;
  // the key blocks of each region: [first[r], first[r + 1]) (a block never crosses a region's end)
  std::vector<int64_t> first(nr + 1, 0);
  for (int64_t r = 0, b = 0; r <= nr; ++r) {
    while (b + 1 < static_cast<int64_t>(kblocks.size()) && kblocks[b] < regions[r]) ++b;
    first[r] = b;
  }
  const auto parts = CostParts(nr * kv, [&](int64_t item) {
    const int64_t r = item / kv;
    int64_t cost = 1;
    for (int64_t b = first[r]; b < first[r + 1]; ++b) {
      cost += Pad16(kblocks[b + 1] - kblocks[b]) * (spans[4 * kblocks[b] + 3] - kblocks[b]);
    }
    return cost;
  });
  const std::vector<float> zero(d, 0.0f);
  OverCostParts(parts, n * heads * d * 64, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = kQueryChunk * groups;
    std::vector<float> s(max_rows * kKeyBlock), dp(max_rows * kKeyBlock), kacc(kKeyBlock * d), vacc(kKeyBlock * d);
    std::vector<float> kpanel(kKeyBlock * d), vpanel(kKeyBlock * d), row_lse(max_rows), row_delta(max_rows);
    std::vector<const float*> qrow(max_rows), grow(max_rows), krow(kKeyBlock);
    std::vector<float*> dqrow(max_rows);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / kv, g = item % kv;
      for (int64_t t = regions[r]; t < regions[r + 1]; ++t) {
        std::memset(dq + (t * heads + g * groups) * d, 0, groups * d * sizeof(float));
      }
      for (int64_t b = first[r]; b < first[r + 1]; ++b) {
        const int64_t j0 = kblocks[b], keys = kblocks[b + 1] - j0, q_end = spans[4 * j0 + 3], cols = Pad16(keys);
        // the block's keys and values as one transposed panel each (columns past the keys zero)
        for (int64_t c = 0; c < cols; ++c) {
          const float* kc = c < keys ? k + ((j0 + c) * kv + g) * d : zero.data();
          const float* vc = c < keys ? v + ((j0 + c) * kv + g) * d : zero.data();
          krow[c] = kc;
          SetPanelColumn(kpanel.data(), c, kc, d);
          SetPanelColumn(vpanel.data(), c, vc, d);
        }
        std::fill(kacc.begin(), kacc.end(), 0.0f);
        std::fill(vacc.begin(), vacc.end(), 0.0f);
        for (int64_t ta = j0; ta < q_end; ta += kQueryChunk) {
          const int64_t tb = std::min(q_end, ta + kQueryChunk), rows = (tb - ta) * groups;
          for (int64_t i = 0; i < rows; ++i) {
            const int64_t t = ta + i / groups, h = t * heads + g * groups + i % groups;
            qrow[i] = q + h * d;
            grow[i] = grad + h * d;
            dqrow[i] = dq + h * d;
            row_lse[i] = lse[h];
            row_delta[i] = delta[h];
          }
          // s = scale q k^T, dp = d out v^T: [rows, cols]
          Dot(qrow.data(), rows, kpanel.data(), d, cols, scale, s.data(), cols);
          Dot(grow.data(), rows, vpanel.data(), d, cols, 1.0f, dp.data(), cols);
          // p = exp(s - lse) and d s = p (d p - delta) on the keys each query reads (key j0 + c <= its token)
          for (int64_t i = 0; i < rows; ++i) {
            float* pr = s.data() + i * cols;
            float* dsr = dp.data() + i * cols;
            const prl::V8 m = prl::V8{} + row_lse[i], dl = prl::V8{} + row_delta[i];
            for (int64_t c = 0; c < cols; c += 8) {
              const prl::V8 p = prl::ExpF8(prl::Load8(pr + c) - m);
              prl::Store8(pr + c, p);
              prl::Store8(dsr + c, p * (prl::Load8(dsr + c) - dl));
            }
            const int64_t t = ta + i / groups;
            for (int64_t c = std::min(keys, t - j0 + 1); c < cols; ++c) pr[c] = dsr[c] = 0.0f;
          }
          // d v += p^T d out, d k += d s^T q (scaled when written), d q += scale d s k
          MixT(s.data(), cols, rows, grow.data(), keys, d, vacc.data());
          MixT(dp.data(), cols, rows, qrow.data(), keys, d, kacc.data());
          Mix(dp.data(), cols, rows, krow.data(), keys, d, scale, dqrow.data(), true);
        }
        for (int64_t i = 0; i < keys; ++i) {
          float* kd = dk + ((j0 + i) * kv + g) * d;
          float* vd = dv + ((j0 + i) * kv + g) * d;
          for (int64_t c = 0; c < d; ++c) {
            kd[c] = scale * kacc[i * d + c];
            vd[c] = vacc[i * d + c];
          }
        }
      }
    }
  });
}

namespace {
// Attend over the (row, kv head) items [begin, end) of caches of `cache` dtype, in the calling thread
void AttendItems(const float* qp, const void* cache_k, const void* cache_v, prl::KvDtype cache, const int64_t* st,
                 const int64_t* shared, float* o, int64_t begin, int64_t end, int64_t heads, int64_t kv, int64_t cap,
                 int64_t d, int64_t length, float scale) {
  prl::ForKvDtype(cache, [&](auto zero) {
    using T = decltype(zero);
    Attend(qp, static_cast<const T*>(cache_k), static_cast<const T*>(cache_v), st, shared, o, begin, end, heads, kv,
           cap, d, length, scale);
  });
}
}  // namespace

void prl_cpu::DecodeAttention(const float* qp, const void* cache_k, const void* cache_v, KvDtype cache,
                              const int64_t* st, float* o, int64_t b, int64_t heads, int64_t kv, int64_t cap,
                              int64_t d, int64_t length, float scale, const int64_t* shared) {
  // (row, kv head) items in parallel, each part with its own scratch
  prl::ParallelFor(b * kv, 2 * heads / kv * length * d, [&](int, int64_t begin, int64_t end) {
    AttendItems(qp, cache_k, cache_v, cache, st, shared, o, begin, end, heads, kv, cap, d, length, scale);
  });
}

namespace prl_cpu {
// DecodeAttention's rows [row_begin, row_end) in the calling thread (q, out, start and shared of the whole batch):
// a decode layer's row range (decode_layer.cc). CPU only, so not among kernels.h's launchers.
void DecodeAttentionRows(const float* qp, const void* cache_k, const void* cache_v, KvDtype cache, const int64_t* st,
                         float* o, int64_t row_begin, int64_t row_end, int64_t heads, int64_t kv, int64_t cap,
                         int64_t d, int64_t length, float scale, const int64_t* shared) {
  AttendItems(qp, cache_k, cache_v, cache, st, shared, o, row_begin * kv, row_end * kv, heads, kv, cap, d, length,
              scale);
}
}  // namespace prl_cpu

#ifndef PRL_NO_PADDLE
#ifdef PRL_WITH_CUDA
std::vector<paddle::Tensor> DecodeAttentionCUDA(const paddle::Tensor& q, const paddle::Tensor& cache_k,
                                                const paddle::Tensor& cache_v, const paddle::Tensor& start,
                                                int64_t length, float scale);
#endif

std::vector<paddle::Tensor> DecodeAttention(const paddle::Tensor& q, const paddle::Tensor& cache_k,
                                            const paddle::Tensor& cache_v, const paddle::Tensor& start, int64_t length,
                                            float scale) {
#ifdef PRL_WITH_CUDA
  if (q.is_gpu()) return DecodeAttentionCUDA(q, cache_k, cache_v, start, length, scale);
#endif
  const char* op = "prl_decode_attention";
  prl::CheckCpuFloat(q, op, "q");
  PD_CHECK(start.dtype() == paddle::DataType::INT64, op, ": start must be int64");
  const auto& qs = q.shape();
  const auto& cs = cache_k.shape();
  PD_CHECK(qs.size() == 4 && qs[1] == 1 && cs.size() == 4, op, ": q [B, 1, H, D], caches [B, KV, C, D]");
  const int64_t b = qs[0], heads = qs[2], d = qs[3], kv = cs[1], cap = cs[2];
  PD_CHECK(cs[0] == b && cs[3] == d && cache_v.shape() == cs && heads % kv == 0, op, ": shape mismatch");
  PD_CHECK(length >= 1 && length <= cap, op, ": length ", length, " outside the cache (", cap, ")");
  PD_CHECK(start.numel() == b, op, ": start must be [B]");
  const prl::KvDtype cache = prl::CpuCacheDtype(cache_k, cache_v, op);
  auto out = paddle::empty({b, 1, heads * d}, q.dtype(), q.place());
  prl_cpu::DecodeAttention(q.data<float>(), cache_k.data(), cache_v.data(), cache, start.data<int64_t>(),
                           out.data<float>(), b, heads, kv, cap, d, length, scale);
  return {out};
}

std::vector<std::vector<int64_t>> DecodeAttentionInferShape(const std::vector<int64_t>& q,
                                                            const std::vector<int64_t>& k,
                                                            const std::vector<int64_t>& v,
                                                            const std::vector<int64_t>& start, int64_t length,
                                                            float scale) {
  return {{q[0], 1, q[2] * q[3]}};
}

std::vector<paddle::DataType> DecodeAttentionInferDtype(paddle::DataType q, paddle::DataType k, paddle::DataType v,
                                                        paddle::DataType start) {
  return {q};
}

PD_BUILD_OP(prl_decode_attention)
    .Inputs({"Q", "CacheK", "CacheV", "Start"})
    .Outputs({"Out"})
    .Attrs({"length: int64_t", "scale: float"})
    .SetKernelFn(PD_KERNEL(DecodeAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(DecodeAttentionInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(DecodeAttentionInferDtype));
#endif  // PRL_NO_PADDLE

#ifndef PRL_NO_PADDLE
namespace {

// q [N, H, D], k and v [N, KV, D] float32 CPU, spans [N, 4] int64 -> (n, heads, kv, d)
std::array<int64_t, 4> PackedAttentionShape(const paddle::Tensor& q, const paddle::Tensor& k, const paddle::Tensor& v,
                                            const paddle::Tensor& spans, const char* op) {
  prl::CheckCpuFloat(q, op, "q");
  prl::CheckCpuFloat(k, op, "k");
  prl::CheckCpuFloat(v, op, "v");
  PD_CHECK(spans.dtype() == paddle::DataType::INT64 && spans.is_cpu(), op, ": spans must be an int64 CPU tensor");
  const auto& qs = q.shape();
  const auto& ks = k.shape();
  PD_CHECK(qs.size() == 3 && ks.size() == 3 && v.shape() == ks, op, ": q [N, H, D], k and v [N, KV, D]");
  PD_CHECK(ks[0] == qs[0] && ks[2] == qs[2] && ks[1] > 0 && qs[1] % ks[1] == 0, op, ": shape mismatch");
  PD_CHECK(spans.shape().size() == 2 && spans.shape()[0] == qs[0] && spans.shape()[1] == 4, op,
           ": spans must be [N, 4]");
  return {qs[0], qs[1], ks[1], qs[2]};
}

}  // namespace

std::vector<paddle::Tensor> PackedAttention(const paddle::Tensor& q, const paddle::Tensor& k, const paddle::Tensor& v,
                                            const paddle::Tensor& spans, float scale) {
  const auto [n, heads, kv, d] = PackedAttentionShape(q, k, v, spans, "prl_packed_attention");
  auto out = paddle::empty({n, heads * d}, paddle::DataType::FLOAT32, q.place());
  auto lse = paddle::empty({n, heads}, paddle::DataType::FLOAT32, q.place());
  prl_cpu::PackedAttentionForward(q.data<float>(), k.data<float>(), v.data<float>(), spans.data<int64_t>(),
                                  out.data<float>(), lse.data<float>(), n, heads, kv, d, scale);
  return {out, lse};
}

std::vector<paddle::Tensor> PackedAttentionGrad(const paddle::Tensor& q, const paddle::Tensor& k,
                                                const paddle::Tensor& v, const paddle::Tensor& spans,
                                                const paddle::Tensor& out, const paddle::Tensor& lse,
                                                const paddle::Tensor& grad_out, float scale) {
  const auto [n, heads, kv, d] = PackedAttentionShape(q, k, v, spans, "prl_packed_attention_grad");
  auto dq = paddle::empty(q.shape(), paddle::DataType::FLOAT32, q.place());
  auto dk = paddle::empty(k.shape(), paddle::DataType::FLOAT32, q.place());
  auto dv = paddle::empty(v.shape(), paddle::DataType::FLOAT32, q.place());
  prl_cpu::PackedAttentionBackward(q.data<float>(), k.data<float>(), v.data<float>(), spans.data<int64_t>(),
                                   out.data<float>(), lse.data<float>(), grad_out.data<float>(), dq.data<float>(),
                                   dk.data<float>(), dv.data<float>(), n, heads, kv, d, scale);
  return {dq, dk, dv};
}

std::vector<std::vector<int64_t>> PackedAttentionInferShape(const std::vector<int64_t>& q,
                                                            const std::vector<int64_t>& k,
                                                            const std::vector<int64_t>& v,
                                                            const std::vector<int64_t>& spans, float scale) {
  return {{q[0], q[1] * q[2]}, {q[0], q[1]}};
}

std::vector<paddle::DataType> PackedAttentionInferDtype(paddle::DataType q, paddle::DataType k, paddle::DataType v,
                                                        paddle::DataType spans) {
  return {q, q};
}

PD_BUILD_OP(prl_packed_attention)
    .Inputs({"Q", "K", "V", "Spans"})
    .Outputs({"Out", "Lse"})
    .Attrs({"scale: float"})
    .SetKernelFn(PD_KERNEL(PackedAttention))
    .SetInferShapeFn(PD_INFER_SHAPE(PackedAttentionInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(PackedAttentionInferDtype));

PD_BUILD_GRAD_OP(prl_packed_attention)
    .Inputs({"Q", "K", "V", "Spans", "Out", "Lse", paddle::Grad("Out")})
    .Outputs({paddle::Grad("Q"), paddle::Grad("K"), paddle::Grad("V")})
    .Attrs({"scale: float"})
    .SetKernelFn(PD_KERNEL(PackedAttentionGrad));
#endif  // PRL_NO_PADDLE
