// Run-time choice of the instruction set for the CPU row kernels (csrc/cpu/simd_kernels.inc).
//
// The extension is compiled for the baseline x86-64 target, so the hot loops are compiled a
// second and third time for AVX2+FMA and AVX-512 (csrc/cpu/isa_*.cpp) and picked here once per
// process from what the running CPU supports.
#pragma once

#include <cstdint>

namespace pullback {
namespace cpu {

#define PULLBACK_DECLARE_ROW_KERNELS(NS)                                                           \
  namespace NS {                                                                                  \
  void copy_bytes(char* dst, const char* src, int64_t bytes);                                     \
  int64_t gram_scratch_doubles(int64_t r);                                                        \
  int64_t product_gram_scratch_doubles(int64_t r);                                                \
  int64_t right_multiply_scratch_doubles(int64_t r);                                              \
  void gram_rows(const float* x, int64_t rows, int64_t r, double* G, double* scratch);            \
  void gram_rows(const double* x, int64_t rows, int64_t r, double* G, double* scratch);           \
  void product_gram_rows(const float* x, int64_t rows, int64_t r, const double* M, double* G,     \
                         double* scratch);                                                        \
  void product_gram_rows(const double* x, int64_t rows, int64_t r, const double* M, double* G,    \
                         double* scratch);                                                        \
  void right_multiply_rows(const float* x, int64_t rows, int64_t r, const double* M1,             \
                           const double* M2, float* y, double* scratch);                          \
  void right_multiply_rows(const double* x, int64_t rows, int64_t r, const double* M1,            \
                           const double* M2, double* y, double* scratch);                         \
  double token_importance_block(const float* u, int64_t D, int64_t r, const float* lam);          \
  double token_importance_block(const double* u, int64_t D, int64_t r, const double* lam);        \
  void project_rows(const float* u, const float* v, int64_t rows, int64_t r, int64_t k,           \
                    double* out, double* vv, float* scratch);                                     \
  void project_rows(const double* u, const double* v, int64_t rows, int64_t r, int64_t k,         \
                    double* out, double* vv, double* scratch);                                    \
  void metric_rows(const float* u, const float* v, int64_t rows, int64_t r, int64_t k,            \
                   const float* c, float eps, float* y, float* scratch);                          \
  void metric_rows(const double* u, const double* v, int64_t rows, int64_t r, int64_t k,          \
                   const double* c, double eps, double* y, double* scratch);                      \
  /* Scratch sizes (in elements of the tag pointer's type) of project_rows / metric_rows. */      \
  int64_t project_scratch_elems(const float*, int64_t r, int64_t k);                              \
  int64_t project_scratch_elems(const double*, int64_t r, int64_t k);                             \
  int64_t metric_scratch_elems(const float*, int64_t r, int64_t k);                               \
  int64_t metric_scratch_elems(const double*, int64_t r, int64_t k);                              \
  }

PULLBACK_DECLARE_ROW_KERNELS(baseline)
#if defined(__x86_64__) && defined(__GNUC__)
#define PULLBACK_HAVE_X86_VARIANTS 1
PULLBACK_DECLARE_ROW_KERNELS(avx2)
PULLBACK_DECLARE_ROW_KERNELS(avx512)
#endif
#undef PULLBACK_DECLARE_ROW_KERNELS

enum class Isa { kBaseline, kAvx2, kAvx512 };

// The widest instruction set this CPU supports among the compiled variants (cached).
Isa active_isa();
const char* isa_name(Isa isa);

// Calls `NAME(args...)` of the variant matching active_isa().
#ifdef PULLBACK_HAVE_X86_VARIANTS
#define PULLBACK_ROW_KERNEL(NAME, ...)                                    \
  (::pullback::cpu::active_isa() == ::pullback::cpu::Isa::kAvx512         \
       ? ::pullback::cpu::avx512::NAME(__VA_ARGS__)                       \
       : ::pullback::cpu::active_isa() == ::pullback::cpu::Isa::kAvx2     \
             ? ::pullback::cpu::avx2::NAME(__VA_ARGS__)                   \
             : ::pullback::cpu::baseline::NAME(__VA_ARGS__))
#else
#define PULLBACK_ROW_KERNEL(NAME, ...) ::pullback::cpu::baseline::NAME(__VA_ARGS__)
#endif

}  // namespace cpu
}  // namespace pullback
