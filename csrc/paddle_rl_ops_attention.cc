// The second translation unit of paddle_rl's fused CPU kernels (see paddle_rl_ops.cc): the attention kernels
// (decode, packed, masked softmax's users) and rotary, the slowest sources to compile.
#include "cpu/attention.cc"
#include "cpu/rotary.cc"
