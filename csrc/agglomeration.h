// The arithmetic and the tie order of `agglomerate` (the greedy agglomeration of ATC and
// importance_cluster) that its CPU kernel (csrc/cpu/agglomeration.cpp) and CUDA kernel
// (csrc/cuda/agglomeration.cu) share with its pure-torch reference (pullback_ext/reference.py,
// `agglomerate`): every value is rounded as the reference rounds it (each product, sum and
// quotient on its own, never contracted into a fused multiply-add), so that the kernels take the
// reference's decisions bit for bit.
#pragma once

#include <cstdint>
#include <limits>

#if defined(__CUDACC__)
#define PULLBACK_AGG_HD __host__ __device__ __forceinline__
#else
#define PULLBACK_AGG_HD inline
#endif

namespace pullback {
namespace agglomeration {

// The linkages, in the order of the names that the op's `linkage` argument takes.
enum Linkage : int { kAverage = 0, kSingle = 1, kComplete = 2, kBound = 3 };
constexpr const char* kLinkageNames[] = {"average", "single", "complete", "bound"};
constexpr int kNumLinkages = 4;

// Products, sums and differences rounded one by one: nvcc would otherwise contract a*b + c into
// an FMA (on the host, csrc/cpu/agglomeration.cpp turns GCC's contraction off; clang contracts
// only within one expression, and each of these is its own).
#if defined(__CUDA_ARCH__)
PULLBACK_AGG_HD float mul(float a, float b) { return __fmul_rn(a, b); }
PULLBACK_AGG_HD double mul(double a, double b) { return __dmul_rn(a, b); }
PULLBACK_AGG_HD float add(float a, float b) { return __fadd_rn(a, b); }
PULLBACK_AGG_HD double add(double a, double b) { return __dadd_rn(a, b); }
PULLBACK_AGG_HD float sub(float a, float b) { return __fsub_rn(a, b); }
PULLBACK_AGG_HD double sub(double a, double b) { return __dsub_rn(a, b); }
#else
template <typename T>
PULLBACK_AGG_HD T mul(T a, T b) { return a * b; }
template <typename T>
PULLBACK_AGG_HD T add(T a, T b) { return a + b; }
template <typename T>
PULLBACK_AGG_HD T sub(T a, T b) { return a - b; }
#endif

template <typename T>
PULLBACK_AGG_HD T infinity() { return std::numeric_limits<T>::infinity(); }

template <typename T>
PULLBACK_AGG_HD bool is_nan(T v) { return v != v; }

// `v` ranks before `w` as torch's argmin ranks them: the smaller first, NaN before any number.
template <typename T>
PULLBACK_AGG_HD bool before(T v, T w) { return v < w || (is_nan(v) && !is_nan(w)); }

// (v, i) ranks before (w, j): the value first, then the smaller index (the first occurrence).
template <typename T>
PULLBACK_AGG_HD bool before_at(T v, int64_t i, T w, int64_t j) {
  return before(v, w) || (!before(w, v) && i < j);
}

// torch.minimum / torch.maximum: NaN propagates.
template <typename T>
PULLBACK_AGG_HD T least(T a, T b) { return (is_nan(a) || a < b) ? a : b; }
template <typename T>
PULLBACK_AGG_HD T largest(T a, T b) { return (is_nan(a) || a > b) ? a : b; }

// The least entry of `row` [n] and its first column (one thread's scan).
template <typename T, typename Index>
PULLBACK_AGG_HD void scan_row(const T* row, Index n, T& least_value, Index& at) {
  least_value = row[0];
  at = 0;
  for (Index j = 1; j < n; ++j) {
    if (before(row[j], least_value)) {
      least_value = row[j];
      at = j;
    }
  }
}

// The weight of the bound between clusters a and b: (E_a S_b² + E_b S_a²) / (S_a + S_b)².
template <typename T>
PULLBACK_AGG_HD T bound_weight(T energy_a, T size_a, T energy_b, T size_b) {
  const T total = add(size_a, size_b);
  return add(mul(energy_a, mul(size_b, size_b)), mul(energy_b, mul(size_a, size_a))) / mul(total, total);
}

// The squared distance of the centre of a ∪ z (sizes sa, sz; sa + sz = s) to a cluster c, from
// c's squared distances da to a and dz to z and the squared distance daz of a and z
// (Lance–Williams for centroids), clamped at 0 against cancellation:
// ((sa da + sz dz) / s) - (sa sz daz) / s².
template <typename T>
PULLBACK_AGG_HD T centre_distance(T sa, T da, T sz, T dz, T s, T daz) {
  const T v = sub(add(mul(sa, da), mul(sz, dz)) / s, mul(mul(sa, sz), daz) / mul(s, s));
  return v < T(0) ? T(0) : v;
}

}  // namespace agglomeration
}  // namespace pullback
