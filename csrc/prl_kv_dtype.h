// The element types a KV cache may have, named by the launchers of the CPU and CUDA kernels (no Paddle here:
// the standalone CUDA check includes it too).
#pragma once

namespace prl {

// float32, or a 16-bit float read back as float32 by the attention and written rounded to nearest even
enum class KvDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline const char* KvDtypeName(KvDtype t) {
  return t == KvDtype::kFloat32 ? "float32" : t == KvDtype::kBFloat16 ? "bfloat16" : "float16";
}

inline int KvDtypeBytes(KvDtype t) { return t == KvDtype::kFloat32 ? 4 : 2; }

}  // namespace prl
