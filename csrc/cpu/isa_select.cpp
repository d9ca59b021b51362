// Picks the row-kernel variant for the running CPU.
#include "cpu/simd.h"

#include <cstdlib>
#include <cstring>

namespace pullback {
namespace cpu {

namespace {

Isa detect_isa() {
#ifdef PULLBACK_HAVE_X86_VARIANTS
  // PULLBACK_CPU_ISA=baseline|avx2 caps the choice (for testing every variant on one machine).
  const char* cap = std::getenv("PULLBACK_CPU_ISA");
  const bool allow_avx512 = cap == nullptr || std::strcmp(cap, "avx512") == 0;
  const bool allow_avx2 = allow_avx512 || std::strcmp(cap, "avx2") == 0;
  __builtin_cpu_init();
  if (allow_avx512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw"))
    return Isa::kAvx512;
  if (allow_avx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return Isa::kAvx2;
#endif
  return Isa::kBaseline;
}

}  // namespace

Isa active_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "baseline";
  }
}

}  // namespace cpu
}  // namespace pullback
