// The greedy choice of merge sources that spares the partner of every source it takes, for one
// image: the loop that the CPU kernel (csrc/cpu/selection.cpp) and the CUDA kernel
// (csrc/cuda/selection.cu) share, so that both select the same tokens.
//
// Each step depends on every earlier one (a chain of partners in cost order alternates between
// taken and spared along its whole length), which is why it is one sequential loop per image and
// not a sequence of tensor operations.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define PULLBACK_HOST_DEVICE __host__ __device__
#else
#define PULLBACK_HOST_DEVICE
#endif

namespace pullback {

// order[n]: the tokens 0..n-1, cheapest first; partner[n]: each token's partner; count <= n.
// Writes the `count` selected tokens to out[count] in increasing order. The candidates are taken
// in `order`, each unless it is the partner of a source taken before it, until `count` are taken;
// should the spared partners leave the budget short, the cheapest tokens not yet taken fill it.
// chosen[n], spared[n]: scratch. Indices out of [0, n) (unchecked calls only) are skipped, never
// addressed; the output is then unspecified (-1 where a row ends short).
template <typename Index>
PULLBACK_HOST_DEVICE inline void select_with_partners_row(const Index* order, const Index* partner,
                                                          int64_t n, int64_t count,
                                                          uint8_t* chosen, uint8_t* spared,
                                                          int64_t* out) {
  for (int64_t t = 0; t < n; ++t) chosen[t] = spared[t] = 0;
  int64_t taken = 0;
  for (int64_t j = 0; j < n && taken < count; ++j) {
    const int64_t c = order[j];
    if (c < 0 || c >= n || chosen[c] || spared[c]) continue;
    chosen[c] = 1;
    ++taken;
    const int64_t p = partner[c];
    if (p >= 0 && p < n) spared[p] = 1;
  }
  for (int64_t j = 0; j < n && taken < count; ++j) {
    const int64_t c = order[j];
    if (c < 0 || c >= n || chosen[c]) continue;
    chosen[c] = 1;
    ++taken;
  }
  int64_t m = 0;
  for (int64_t t = 0; t < n && m < count; ++t) {
    if (chosen[t]) out[m++] = t;
  }
  for (; m < count; ++m) out[m] = -1;
}

}  // namespace pullback
