// Row kernels compiled for AVX2 + FMA; selected at run time by active_isa().
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/simd.h"

#ifdef PULLBACK_HAVE_X86_VARIANTS
#pragma GCC target("avx2,fma")
#define PULLBACK_ISA_NS avx2
#define PULLBACK_VEC_BYTES 32
#include "cpu/simd_kernels.inc"
#endif
