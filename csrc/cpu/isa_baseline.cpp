// Row kernels for the baseline target of the build (SSE2 on x86-64).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/simd.h"

#define PULLBACK_ISA_NS baseline
#define PULLBACK_VEC_BYTES 16
#include "cpu/simd_kernels.inc"
