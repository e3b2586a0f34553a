// The CPU kernels of csrc/cpu behind plain launchers: raw pointers to contiguous row-major arrays, sizes, the KV
// cache's dtype as an enum. The Paddle ops (PD_BUILD_OP in each csrc/cpu/*.cc) check their tensors, allocate the
// outputs and call these; the standalone CUDA check (csrc/cuda/test) calls them without Paddle, compiling the .cc
// files with -DPRL_NO_PADDLE. Inputs are trusted here: shapes, dtypes and index bounds are the callers' checks.
#pragma once

#include <cstdint>

#include "../prl_kv_dtype.h"
#include "../prl_lowp.h"

namespace prl_cpu {

using prl::KvDtype;
using prl::LowpFormat;

// x, y [n, d]; rstd [n] (1 / rms of each row); y = (x * rstd) * w.
void RmsNormForward(const float* x, const float* w, float* y, float* rstd, int64_t n, int64_t d, float eps);
// grad, gx [n, d]; gw [d] (overwritten: the sum over rows).
void RmsNormBackward(const float* x, const float* w, const float* rstd, const float* grad, float* gx, float* gw,
                     int64_t n, int64_t d);

// x [n, 2f] = [gate | up] -> out [n, f] = silu(gate) * up; the backward writes grad [n, 2f] from grad_out [n, f].
void SwigluForward(const float* x, float* out, int64_t n, int64_t f);
void SwigluBackward(const float* x, const float* grad_out, float* grad, int64_t n, int64_t f);

// x, out [b, l, heads, d]; cos, sin [table_batch (1 or b), l, d]; inverse: the backward's rotation.
void Rotary(const float* x, const float* cos, const float* sin, float* out, int64_t b, int64_t l, int64_t heads,
            int64_t d, int64_t table_batch, bool inverse);

// qkv [b, l, (num_heads + 2 num_kv_heads) d]; positions [b, l]; inv_freq [d / 2]; q [b, l, num_heads, d];
// caches [b, num_kv_heads, cap, d] of `cache` dtype, written at slots slot .. slot + l - 1; q_norm, k_norm [d] or
// null.
void RotaryQkvCache(const float* qkv, const int64_t* positions, const float* inv_freq, float* q, void* cache_k,
                    void* cache_v, KvDtype cache, const float* q_norm, const float* k_norm, int64_t b, int64_t l,
                    int num_heads, int num_kv_heads, int64_t d, int64_t cap, int64_t slot, float eps);

// q [b, heads, d]; caches [b, kv, cap, d] of `cache` dtype; start [b]; out [b, heads, d]. shared [b, 2] or null:
// row r's slots start[r] .. shared[r][1] - 1 hold the same numbers as row shared[r][0]'s (a prompt fanned out to
// its samples) and are read from that row (the same result, the prompt read from memory once).
void DecodeAttention(const float* q, const void* cache_k, const void* cache_v, KvDtype cache, const int64_t* start,
                     float* out, int64_t b, int64_t heads, int64_t kv, int64_t cap, int64_t d, int64_t length,
                     float scale, const int64_t* shared = nullptr);

// dst [*, heads, dst_cap, d], src [*, heads, src_cap, d] of elements of elem_bytes bytes; rows [n] in range.
void KvPlace(void* dst, const void* src, const int64_t* rows, int64_t n, int64_t heads, int64_t d,
             int64_t elem_bytes, int64_t dst_cap, int64_t src_cap, int64_t dst_row, int64_t src_start,
             int64_t dst_start, int64_t width);

// logits [n, v]; labels [n] in [0, v); logp, entropy, lse, mean_z [n].
void LogprobForward(const float* logits, const int64_t* labels, float* logp, float* entropy, float* lse,
                    float* mean_z, int64_t n, int64_t v, float scale);
// grad [n, v]; grad_entropy [n] or null.
void LogprobBackward(const float* logits, const int64_t* labels, const float* lse, const float* mean_z,
                     const float* grad_logp, const float* grad_entropy, float* grad, int64_t n, int64_t v,
                     float scale);


// Every array [b] but stop [n_stop], seen [b, v] (or null: v unused) and done [1].
void StepUpdate(const int64_t* tokens, const float* logprob, const bool* finished, const int64_t* lengths,
                const int64_t* stop, int64_t n_stop, float* seen, int64_t v, int64_t* tokens_out, float* logprob_out,
                bool* finished_out, int64_t* lengths_out, bool* ban, bool* done, int64_t b, int64_t pad_id,
                int64_t min_len);

// logits, seen [b, v]; uniforms, ban, tokens, logprob [b]; seen, ban (and uniforms when greedy) may be null.
void Sample(const float* logits, const float* seen, const float* uniforms, const bool* ban, const int64_t* stop,
            int64_t n_stop, int64_t* tokens, float* logprob, int64_t b, int64_t v, float temperature, int top_k,
            float top_p, float penalty);

// w [k_dim, n] (or [n, k_dim] transposed) -> packed (prl::LowpPackedBytes(format, k_dim, n) bytes) and scales
// (prl::LowpScaleCount floats), the layouts csrc/cpu/linear.cc describes. CPU only: the GPU reads this pack.
void PackWeightLowp(const float* w, LowpFormat format, void* packed, float* scales, int64_t k_dim, int64_t n,
                    bool transposed);
// x [rows, k_dim] times a packed weight -> out [rows, n]; bf16_act rounds x to bfloat16 first (bfloat16 weights
// always do).
void PackedLinearLowp(const float* x, const void* packed, const float* scales, LowpFormat format, float* out,
                      int64_t rows, int64_t k_dim, int64_t n, bool bf16_act);
// C [m, n] = op(A) op(B) with A [m, k] (or [k, m] with trans_a), B [k, n] (or [n, k] with trans_b), both rounded to
// bfloat16 (nearest even), float32 sums; A and B float32, or bfloat16 bits with a_bf16 / b_bf16 (prl_to_bf16's: the
// same product).
// kernel kAuto: the best usable; false when the kernel asked for (or any, for kAuto) is not usable on this CPU, OS
// and build. Bf16MatmulKernels: bit 0 AMX-BF16, bit 1 AVX512-BF16, bit 2 AVX2 (FMA on the values widened to float32).
enum class Bf16Kernel : int { kAuto = 0, kAmx = 1, kAvx512Bf16 = 2, kAvx2 = 3 };
int Bf16MatmulKernels();
// accumulate: C += op(A) op(B) (each sum starts from C's value).
bool Bf16Matmul(const void* a, bool a_bf16, const void* b, bool b_bf16, float* c, int64_t m, int64_t n, int64_t k,
                bool trans_a, bool trans_b, Bf16Kernel kernel, bool accumulate = false);
// Bf16Matmul with B packed once: Bf16PackB writes B [k, n] (or [n, k] trans_b) rounded and packed into
// Bf16PackedWords(n, k) words (and returns that count); Bf16MatmulPacked multiplies op(A) by it (Bf16Matmul's
// numbers).
int64_t Bf16PackedWords(int64_t n, int64_t k);
int64_t Bf16PackB(const void* b, bool b_bf16, uint32_t* packed, int64_t n, int64_t k, bool trans_b);
bool Bf16MatmulPacked(const void* a, bool a_bf16, const uint32_t* packed_b, float* c, int64_t m, int64_t n,
                      int64_t k, bool trans_a, Bf16Kernel kernel, bool accumulate = false);
// The bfloat16 rollout product by AMX tiles where the CPU, OS and build run them (false, nothing written, where
// they do not): xp [rows, k2] the activations as bfloat16 pairs (k = 2 kk in the low half), packed the bfloat16
// panels of PackWeightLowp ([panels][k2][32 columns x 2]), out [rows, n]. Each row's sums run over k in the same
// order whatever the other rows are.
bool PackedLinearBF16Amx(const uint32_t* xp, const uint16_t* packed, float* out, int64_t rows, int64_t k2, int64_t n);
// The int8-weight rollout product on the same AMX-BF16 tiles (false, nothing written, where they do not run): x
// [rows, k_dim] float32 taken as the sum of `parts` (1-3) bfloat16 terms (1: x rounded to nearest even; 3: x
// exactly), packed and scales PackWeightLowp's int8 panels; out [rows, n] = scale_j * the sum over the parts and
// k of the products (each exact in float32), in the tiles' order. A row's result does not depend on the others.
bool PackedLinearInt8Amx(const float* x, int parts, const int8_t* packed, const float* scales, float* out,
                         int64_t rows, int64_t k_dim, int64_t n);

}  // namespace prl_cpu
