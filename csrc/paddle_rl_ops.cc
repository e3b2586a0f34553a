// paddle_rl's fused CPU kernels (and the CUDA dispatch of csrc/cuda/*.cu when PRL_WITH_CUDA is defined),
// compiled as one translation unit: paddle/extension.h dominates the compile time, so it is parsed once.
#include "cpu/attention.cc"
#include "cpu/bf16_matmul.cc"
#include "cpu/kv_cache.cc"
#include "cpu/linear.cc"
#include "cpu/logprob.cc"
#include "cpu/masked_softmax.cc"
#include "cpu/rms_norm.cc"
#include "cpu/rollout_state.cc"
#include "cpu/rotary.cc"
#include "cpu/sampling.cc"
#include "cpu/swiglu.cc"
// last: it calls the launchers above (prl_cpu::PackedLinear of linear.cc among them)
#include "cpu/decode_layer.cc"
