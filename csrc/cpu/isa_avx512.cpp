// Row kernels compiled for AVX-512 (F, VL, DQ, BW); selected at run time by active_isa().
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/simd.h"

#ifdef PULLBACK_HAVE_X86_VARIANTS
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")
#define PULLBACK_ISA_NS avx512
#define PULLBACK_VEC_BYTES 64
#include "cpu/simd_kernels.inc"
#endif
