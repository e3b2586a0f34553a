// paddle_rl's fused CPU kernels (and the CUDA dispatch of csrc/cuda/*.cu when PRL_WITH_CUDA is defined), in two
// translation units that the build compiles side by side (ops/build.py CPU_UNITS). Paddle's headers take ~13 s of
// each unit's compile and the kernels ~20 s more per unit, so two units on two cores take ~0.65x the time of one
// (39 s against 60 s); a unit per source would parse the headers twelve times, slower on a 2-core machine. This
// unit: everything but attention and rotary (paddle_rl_ops_attention.cc).
#include "cpu/bf16_matmul.cc"
#include "cpu/kv_cache.cc"
#include "cpu/linear.cc"
#include "cpu/logprob.cc"
#include "cpu/masked_softmax.cc"
#include "cpu/rms_norm.cc"
#include "cpu/rollout_state.cc"
#include "cpu/sampling.cc"
#include "cpu/swiglu.cc"
// after linear.cc: it calls prl_cpu::PackedLinear and the packs' format check defined there
#include "cpu/decode_layer.cc"
