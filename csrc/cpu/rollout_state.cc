// The per-step bookkeeping of the rollout in one pass over the rows:
//   alive = !finished; tokens of finished rows become pad_id and their log-probs 0; lengths += alive;
//   finished |= alive && token is a stop id; seen[row, token] = 1 for alive rows (in place, when given);
//   ban = lengths < min_len (rows whose stop tokens are banned at the next step); done = all(finished).
#include "../prl_common.h"
#include "kernels.h"

void prl_cpu::StepUpdate(const int64_t* tk, const float* lp, const bool* fin, const int64_t* len, const int64_t* stop,
                         int64_t n_stop, float* sp, int64_t v, int64_t* tko, float* lpo, bool* fo, int64_t* lo,
                         bool* bo, bool* done, int64_t b, int64_t pad_id, int64_t min_len) {
  bool all = true;
  for (int64_t r = 0; r < b; ++r) {
    const bool alive = !fin[r];
    const int64_t t = alive ? tk[r] : pad_id;
    bool stopped = false;
    for (int64_t k = 0; k < n_stop; ++k) stopped = stopped || (stop[k] == t);
    tko[r] = t;
    lpo[r] = alive ? lp[r] : 0.0f;
    lo[r] = len[r] + (alive ? 1 : 0);
    fo[r] = fin[r] || (alive && stopped);
    bo[r] = lo[r] < min_len;
    all = all && fo[r];
    if (sp != nullptr && alive && t >= 0 && t < v) sp[r * v + t] = 1.0f;
  }
  done[0] = all;
}

#ifndef PRL_NO_PADDLE
#ifdef PRL_WITH_CUDA
std::vector<paddle::Tensor> StepUpdateCUDA(const paddle::Tensor& tokens, const paddle::Tensor& logprob,
                                           const paddle::Tensor& finished, const paddle::Tensor& lengths,
                                           const paddle::Tensor& stop_ids, paddle::optional<paddle::Tensor>& seen,
                                           int64_t pad_id, int64_t min_len);
#endif

std::vector<paddle::Tensor> StepUpdate(const paddle::Tensor& tokens, const paddle::Tensor& logprob,
                                       const paddle::Tensor& finished, const paddle::Tensor& lengths,
                                       const paddle::Tensor& stop_ids, paddle::optional<paddle::Tensor>& seen,
                                       int64_t pad_id, int64_t min_len) {
#ifdef PRL_WITH_CUDA
  if (tokens.is_gpu()) return StepUpdateCUDA(tokens, logprob, finished, lengths, stop_ids, seen, pad_id, min_len);
#endif
  const char* op = "prl_step_update";
  const int64_t b = tokens.numel();
  PD_CHECK(tokens.dtype() == paddle::DataType::INT64 && lengths.dtype() == paddle::DataType::INT64 &&
               stop_ids.dtype() == paddle::DataType::INT64, op, ": tokens, lengths and stop_ids must be int64");
  PD_CHECK(finished.dtype() == paddle::DataType::BOOL, op, ": finished must be bool");
  PD_CHECK(logprob.numel() == b && finished.numel() == b && lengths.numel() == b, op, ": shapes must be [B]");
  auto tokens_out = paddle::empty({b}, paddle::DataType::INT64, tokens.place());
  auto logprob_out = paddle::empty({b}, paddle::DataType::FLOAT32, tokens.place());
  auto finished_out = paddle::empty({b}, paddle::DataType::BOOL, tokens.place());
  auto lengths_out = paddle::empty({b}, paddle::DataType::INT64, tokens.place());
  auto ban = paddle::empty({b}, paddle::DataType::BOOL, tokens.place());
  auto done = paddle::empty({1}, paddle::DataType::BOOL, tokens.place());
  float* sp = nullptr;
  int64_t v = 0;
  if (seen) {
    prl::CheckCpuFloat(*seen, op, "seen");
    v = seen->shape().back();
    PD_CHECK(seen->numel() == b * v, op, ": seen must be [B, V]");
    sp = seen->data<float>();
  }
  prl_cpu::StepUpdate(tokens.data<int64_t>(), logprob.data<float>(), finished.data<bool>(), lengths.data<int64_t>(),
                      stop_ids.data<int64_t>(), stop_ids.numel(), sp, v, tokens_out.data<int64_t>(),
                      logprob_out.data<float>(), finished_out.data<bool>(), lengths_out.data<int64_t>(),
                      ban.data<bool>(), done.data<bool>(), b, pad_id, min_len);
  return {tokens_out, logprob_out, finished_out, lengths_out, ban, done};
}

std::vector<std::vector<int64_t>> StepUpdateInferShape(const std::vector<int64_t>& tokens,
                                                       const std::vector<int64_t>& logprob,
                                                       const std::vector<int64_t>& finished,
                                                       const std::vector<int64_t>& lengths,
                                                       const std::vector<int64_t>& stop_ids,
                                                       const paddle::optional<std::vector<int64_t>>& seen,
                                                       int64_t pad_id, int64_t min_len) {
  std::vector<int64_t> b = {tokens[0]};
  return {b, b, b, b, b, {1}, seen ? *seen : std::vector<int64_t>{1}};
}

std::vector<paddle::DataType> StepUpdateInferDtype(paddle::DataType tokens, paddle::DataType logprob,
                                                   paddle::DataType finished, paddle::DataType lengths,
                                                   paddle::DataType stop_ids,
                                                   const paddle::optional<paddle::DataType>& seen) {
  return {paddle::DataType::INT64, paddle::DataType::FLOAT32, paddle::DataType::BOOL, paddle::DataType::INT64,
          paddle::DataType::BOOL,  paddle::DataType::BOOL,    seen ? *seen : paddle::DataType::FLOAT32};
}

PD_BUILD_OP(prl_step_update)
    .Inputs({"Tokens", "Logprob", "Finished", "Lengths", "StopIds", paddle::Optional("Seen")})
    .Outputs({"TokensOut", "LogprobOut", "FinishedOut", "LengthsOut", "Ban", "Done", paddle::Optional("SeenOut")})
    .Attrs({"pad_id: int64_t", "min_len: int64_t"})
    .SetInplaceMap({{paddle::Optional("Seen"), paddle::Optional("SeenOut")}})
    .SetKernelFn(PD_KERNEL(StepUpdate))
    .SetInferShapeFn(PD_INFER_SHAPE(StepUpdateInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(StepUpdateInferDtype));
#endif  // PRL_NO_PADDLE
