// CUDA per-step rollout bookkeeping (see csrc/cpu/rollout_state.cc): one block walks the rows.
#include "prl_cuda.cuh"

namespace {

__global__ void StepUpdateKernel(const int64_t* tokens, const float* logprob, const bool* finished,
                                 const int64_t* lengths, const int64_t* stop, int64_t n_stop, float* seen, int64_t v,
                                 int64_t* tokens_out, float* logprob_out, bool* finished_out, int64_t* lengths_out,
                                 bool* ban, bool* done, int64_t b, int64_t pad_id, int64_t min_len) {
  __shared__ int all;
  if (threadIdx.x == 0) all = 1;
  __syncthreads();
  for (int64_t r = threadIdx.x; r < b; r += blockDim.x) {
    const bool alive = !finished[r];
    const int64_t t = alive ? tokens[r] : pad_id;
    bool stopped = false;
    for (int64_t k = 0; k < n_stop; ++k) stopped = stopped || stop[k] == t;
    tokens_out[r] = t;
    logprob_out[r] = alive ? logprob[r] : 0.0f;
    lengths_out[r] = lengths[r] + (alive ? 1 : 0);
    finished_out[r] = finished[r] || (alive && stopped);
    ban[r] = lengths_out[r] < min_len;
    if (!finished_out[r]) all = 0;
    if (seen != nullptr && alive && t >= 0 && t < v) seen[r * v + t] = 1.0f;
  }
  __syncthreads();
  if (threadIdx.x == 0) done[0] = all != 0;
}

}  // namespace

cudaError_t prl_cuda::StepUpdate(const int64_t* tokens, const float* logprob, const bool* finished,
                                 const int64_t* lengths, const int64_t* stop, int64_t n_stop, float* seen, int64_t v,
                                 int64_t* tokens_out, float* logprob_out, bool* finished_out, int64_t* lengths_out,
                                 bool* ban, bool* done, int64_t b, int64_t pad_id, int64_t min_len,
                                 cudaStream_t stream) {
  StepUpdateKernel<<<1, 1024, 0, stream>>>(tokens, logprob, finished, lengths, n_stop ? stop : nullptr, n_stop, seen,
                                           v, tokens_out, logprob_out, finished_out, lengths_out, ban, done, b,
                                           pad_id, min_len);
  return cudaGetLastError();
}

#ifndef PRL_NO_PADDLE
std::vector<paddle::Tensor> StepUpdateCUDA(const paddle::Tensor& tokens, const paddle::Tensor& logprob,
                                           const paddle::Tensor& finished, const paddle::Tensor& lengths,
                                           const paddle::Tensor& stop_ids, paddle::optional<paddle::Tensor>& seen,
                                           int64_t pad_id, int64_t min_len) {
  const int64_t b = tokens.numel();
  const auto place = tokens.place();
  auto tokens_out = paddle::empty({b}, paddle::DataType::INT64, place);
  auto logprob_out = paddle::empty({b}, paddle::DataType::FLOAT32, place);
  auto finished_out = paddle::empty({b}, paddle::DataType::BOOL, place);
  auto lengths_out = paddle::empty({b}, paddle::DataType::INT64, place);
  auto ban = paddle::empty({b}, paddle::DataType::BOOL, place);
  auto done = paddle::empty({1}, paddle::DataType::BOOL, place);
  float* seen_ptr = seen ? seen->data<float>() : nullptr;
  const int64_t v = seen ? seen->shape().back() : 0;
  prl_cuda::CheckLaunch(
      prl_cuda::StepUpdate(tokens.data<int64_t>(), logprob.data<float>(), finished.data<bool>(),
                           lengths.data<int64_t>(), stop_ids.numel() ? stop_ids.data<int64_t>() : nullptr,
                           stop_ids.numel(), seen_ptr, v, tokens_out.data<int64_t>(), logprob_out.data<float>(),
                           finished_out.data<bool>(), lengths_out.data<int64_t>(), ban.data<bool>(),
                           done.data<bool>(), b, pad_id, min_len, tokens.stream()),
      "prl_step_update");
  return {tokens_out, logprob_out, finished_out, lengths_out, ban, done};
}
#endif  // PRL_NO_PADDLE
