// The second translation unit of paddle_rl's fused CPU kernels (see paddle_rl_ops.cc): decode and packed attention
// and rotary, the slowest sources to compile (~20 s of the unit's ~33 s alone on the EPYC Zen 3).
#include "cpu/attention.cc"
#include "cpu/rotary.cc"
