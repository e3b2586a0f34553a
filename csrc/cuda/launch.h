// The CUDA kernels of csrc/cuda behind plain launchers: raw device pointers to contiguous row-major arrays, sizes,
// the KV cache's dtype as an enum, and the stream to enqueue on. No Paddle here: the Paddle ops' CUDA entries
// (csrc/cuda/*.cu) call these on their tensors' stream, and the standalone check (csrc/cuda/test/prl_cuda_check.cu)
// calls them on buffers of its own. Shapes and index bounds are the callers' checks. Each returns
// cudaGetLastError() after enqueueing (cudaSuccess when there is nothing to do); none synchronizes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "../prl_kv_dtype.h"
#include "../prl_lowp.h"

namespace prl_cuda {

using prl::KvDtype;
using prl::LowpFormat;

// x, y [n, d]; rstd [n]; y = (x * rstd) * w, rstd = 1 / rms of each row.
cudaError_t RmsNormForward(const float* x, const float* w, float* y, float* rstd, int64_t n, int64_t d, float eps,
                           cudaStream_t stream);
// grad, gx [n, d]; gw [d]: zeroed here, then the sum over rows (atomic adds: its order is not fixed).
cudaError_t RmsNormBackward(const float* x, const float* w, const float* rstd, const float* grad, float* gx,
                            float* gw, int64_t n, int64_t d, cudaStream_t stream);

// x [n, 2f] = [gate | up] -> out [n, f] = silu(gate) * up; the backward writes grad [n, 2f] from grad_out [n, f].
cudaError_t SwigluForward(const float* x, float* out, int64_t n, int64_t f, cudaStream_t stream);
cudaError_t SwigluBackward(const float* x, const float* grad_out, float* grad, int64_t n, int64_t f,
                           cudaStream_t stream);

// x, out [b, l, heads, d]; cos, sin [table_batch (1 or b), l, d]; inverse: the backward's rotation.
cudaError_t Rotary(const float* x, const float* cos, const float* sin, float* out, int64_t b, int64_t l,
                   int64_t heads, int64_t d, int64_t table_batch, bool inverse, cudaStream_t stream);

// qkv [b, l, (num_heads + 2 num_kv_heads) d]; positions [b, l]; inv_freq [d / 2]; q [b, l, num_heads, d];
// caches [b, num_kv_heads, cap, d] of `cache` dtype, written at slots slot .. slot + l - 1; q_norm, k_norm [d] or
// null. head_dim d <= 1024.
cudaError_t RotaryQkvCache(const float* qkv, const int64_t* positions, const float* inv_freq, float* q,
                           void* cache_k, void* cache_v, KvDtype cache, const float* q_norm, const float* k_norm,
                           int64_t b, int64_t l, int num_heads, int num_kv_heads, int64_t d, int64_t cap,
                           int64_t slot, float eps, cudaStream_t stream);

// Floats of scratch DecodeAttention needs: the scores of every (row, head) over the cache's slots.
inline size_t DecodeAttentionScratch(int64_t b, int64_t heads, int64_t cap) {
  return static_cast<size_t>(b * heads * cap);
}
// q [b, heads, d]; caches [b, kv, cap, d] of `cache` dtype; start [b]; out [b, heads, d]; scores: scratch.
cudaError_t DecodeAttention(const float* q, const void* cache_k, const void* cache_v, KvDtype cache,
                            const int64_t* start, float* scores, float* out, int64_t b, int64_t heads, int64_t kv,
                            int64_t cap, int64_t d, int64_t length, float scale, cudaStream_t stream);

// dst [*, heads, dst_cap, d], src [src_count, heads, src_cap, d] of elements of elem_bytes bytes; rows [n] (a row
// outside [0, src_count) is skipped, its dst window left as it was). Copies in the widest of 16 / 8 / 4 / 2 / 1-byte
// units that the head's bytes and both base addresses allow.
cudaError_t KvPlace(void* dst, const void* src, const int64_t* rows, int64_t n, int64_t heads, int64_t d,
                    int64_t elem_bytes, int64_t dst_cap, int64_t src_cap, int64_t src_count, int64_t dst_row,
                    int64_t src_start, int64_t dst_start, int64_t width, cudaStream_t stream);

// logits [n, v]; labels [n] (clamped into [0, v)); logp, entropy, lse, mean_z [n].
cudaError_t LogprobForward(const float* logits, const int64_t* labels, float* logp, float* entropy, float* lse,
                           float* mean_z, int64_t n, int64_t v, float scale, cudaStream_t stream);
// grad [n, v]; grad_entropy [n] or null.
cudaError_t LogprobBackward(const float* logits, const int64_t* labels, const float* lse, const float* mean_z,
                            const float* grad_logp, const float* grad_entropy, float* grad, int64_t n, int64_t v,
                            float scale, cudaStream_t stream);

// Every array [b] but stop [n_stop] (null when n_stop is 0), seen [b, v] (or null: v unused) and done [1].
cudaError_t StepUpdate(const int64_t* tokens, const float* logprob, const bool* finished, const int64_t* lengths,
                       const int64_t* stop, int64_t n_stop, float* seen, int64_t v, int64_t* tokens_out,
                       float* logprob_out, bool* finished_out, int64_t* lengths_out, bool* ban, bool* done,
                       int64_t b, int64_t pad_id, int64_t min_len, cudaStream_t stream);

// Doubles of scratch Sample needs: two float64 copies of the logits.
inline size_t SampleScratch(int64_t b, int64_t v) { return static_cast<size_t>(2 * b * v); }
// logits, seen [b, v]; uniforms, ban, tokens, logprob [b]; seen, ban (and uniforms when greedy) may be null; stop
// [n_stop] (null when n_stop is 0); scratch: SampleScratch(b, v) doubles.
cudaError_t Sample(const float* logits, const float* seen, const float* uniforms, const bool* ban,
                   const int64_t* stop, int64_t n_stop, double* scratch, int64_t* tokens, float* logprob, int64_t b,
                   int64_t v, float temperature, int top_k, float top_p, float penalty, cudaStream_t stream);

// x [rows, k_dim] times a weight packed by the CPU's prl_cpu::PackWeightLowp (its bytes and scales copied to the
// device; packed 16-byte aligned, else cudaErrorMisalignedAddress) -> out [rows, n]; bf16_act rounds x to bfloat16
// first (bfloat16 weights always do). float32 sums in another order than the CPU's (see csrc/cuda/linear_lowp.cu).
cudaError_t PackedLinearLowp(const float* x, const void* packed, const float* scales, LowpFormat format, float* out,
                             int64_t rows, int64_t k_dim, int64_t n, bool bf16_act, cudaStream_t stream);

}  // namespace prl_cuda
