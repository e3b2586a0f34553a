// paddle_rl's fused CPU kernels (and the CUDA dispatch of csrc/cuda/*.cu when PRL_WITH_CUDA is defined), in two
// translation units that the build compiles side by side (ops/build.py CPU_UNITS): paddle/extension.h takes about
// as long to parse as the kernels of either unit take to compile, so two units on two cores take ~0.6x the time
// of one, and more units would cost more than they save on a 2-core machine. This unit: everything but the
// attention kernels and rotary (paddle_rl_ops_attention.cc).
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
