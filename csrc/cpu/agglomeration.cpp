// CPU kernel of agglomerate (the greedy agglomeration of ATC and importance_cluster,
// csrc/agglomeration.h), its schema and its CPU registration.
//
// One image per at::parallel_for task. The closest pair is found from a cache of each row's
// least entry (the first one on ties): the first minimum of the symmetric matrix in row-major
// order is the cached minimum of the first row that holds the least value. After a merge of (a, z)
// only row a is rescanned, and every row whose cached minimum sat at a or z; the other rows compare
// their new entry at a with their cached minimum. A step is O(n) but for those rescans, the whole
// agglomeration O(n²) per image where the reference's loop of tensor ops is O(n³).
#if defined(__GNUC__) && !defined(__clang__)
// Each product and sum is rounded on its own, as the reference rounds it (csrc/agglomeration.h).
#pragma GCC optimize("fp-contract=off")
#endif

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "agglomeration.h"
#include "invariants.h"

namespace pullback {
namespace cpu {

namespace {

using namespace agglomeration;

template <typename T>
struct Workspace {
  std::vector<T> matrix;  // the values compared: distances, or the bound's costs
  std::vector<T> second;  // average: summed member distances; bound: squared centre distances
  std::vector<T> size, energy, line, row_min;
  std::vector<int64_t> row_arg;
  std::vector<uint8_t> active;
  Workspace(int64_t n, bool with_second)
      : matrix(n * n), second(with_second ? n * n : 0), size(n), energy(n), line(n), row_min(n), row_arg(n),
        active(n) {}
};

// Row and column `at` of the n×n `matrix` set to `line`.
template <typename T>
void set_line(T* matrix, int64_t n, int64_t at, const T* line) {
  for (int64_t j = 0; j < n; ++j) matrix[at * n + j] = matrix[j * n + at] = line[j];
}

template <typename T>
void set_line_infinite(T* matrix, int64_t n, int64_t at) {
  for (int64_t j = 0; j < n; ++j) matrix[at * n + j] = matrix[j * n + at] = infinity<T>();
}

// dist [n, n], sizes and energy [n] (bound only) -> owner [n].
template <typename T>
void agglomerate_image(const T* dist, const T* sizes, const T* energies, int64_t n, int64_t count, int linkage,
                       Workspace<T>& w, int64_t* owner) {
  for (int64_t t = 0; t < n; ++t) owner[t] = t;
  if (count >= n) return;
  T* m = w.matrix.data();
  T* v = w.second.data();
  T* size = w.size.data();
  T* energy = w.energy.data();
  T* line = w.line.data();
  for (int64_t t = 0; t < n; ++t) {
    size[t] = linkage == kBound ? sizes[t] : T(1);
    energy[t] = linkage == kBound ? energies[t] : T(0);
    w.active[t] = 1;
  }
  if (linkage == kBound) {
    std::copy(dist, dist + n * n, v);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        m[i * n + j] = i == j ? infinity<T>() : mul(bound_weight(energy[i], size[i], energy[j], size[j]), dist[i * n + j]);
      }
    }
  } else {
    std::copy(dist, dist + n * n, m);
    if (linkage == kAverage) std::copy(dist, dist + n * n, v);
  }
  for (int64_t i = 0; i < n; ++i) scan_row(m + i * n, n, w.row_min[i], w.row_arg[i]);

  for (int64_t step = 0; step < n - count; ++step) {
    int64_t a = 0;
    for (int64_t i = 1; i < n; ++i) {
      if (before(w.row_min[i], w.row_min[a])) a = i;
    }
    const int64_t z = w.row_arg[a];
    if (linkage == kBound) {
      const T sa = size[a], sz = size[z], s = add(sa, sz), e = add(energy[a], energy[z]), daz = v[a * n + z];
      size[a] = s;
      energy[a] = e;
      w.active[z] = 0;
      for (int64_t j = 0; j < n; ++j) line[j] = centre_distance(sa, v[a * n + j], sz, v[z * n + j], s, daz);
      set_line(v, n, a, line);
      for (int64_t j = 0; j < n; ++j) {
        line[j] = (w.active[j] && j != a) ? mul(bound_weight(e, s, energy[j], size[j]), line[j]) : infinity<T>();
      }
    } else if (linkage == kAverage) {
      size[a] = add(size[a], size[z]);
      for (int64_t j = 0; j < n; ++j) line[j] = (j == a || j == z) ? infinity<T>() : add(v[a * n + j], v[z * n + j]);
      set_line_infinite(v, n, z);
      set_line(v, n, a, line);
      for (int64_t j = 0; j < n; ++j) line[j] = line[j] / mul(size[a], size[j]);
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const T first = m[a * n + j], second = m[z * n + j];
        line[j] = (j == a || j == z) ? infinity<T>() : (linkage == kSingle ? least(first, second) : largest(first, second));
      }
    }
    set_line_infinite(m, n, z);
    set_line(m, n, a, line);

    w.row_min[z] = infinity<T>();
    w.row_arg[z] = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (i == a || i == z) continue;
      const int64_t at = w.row_arg[i];
      if (at == a || at == z || !(w.row_min[i] < infinity<T>())) {
        scan_row(m + i * n, n, w.row_min[i], w.row_arg[i]);
      } else if (before_at(m[i * n + a], a, w.row_min[i], at)) {
        w.row_min[i] = m[i * n + a];
        w.row_arg[i] = a;
      }
    }
    scan_row(m + a * n, n, w.row_min[a], w.row_arg[a]);
    for (int64_t t = 0; t < n; ++t) {
      if (owner[t] == z) owner[t] = a;
    }
  }
}

at::Tensor agglomerate(const at::Tensor& dist_in, const std::optional<at::Tensor>& sizes_in,
                       const std::optional<at::Tensor>& energy_in, int64_t count, c10::string_view linkage_name) {
  const int linkage = expect_agglomeration_operands(dist_in, sizes_in, energy_in, count, linkage_name);
  const at::Tensor dist = dist_in.contiguous();
  const int64_t B = dist.size(0), n = dist.size(1);
  at::Tensor owner = at::empty({B, n}, dist.options().dtype(at::kLong));
  if (owner.numel() == 0) return owner;
  const at::Tensor sizes = linkage == kBound ? sizes_in->contiguous() : at::Tensor();
  const at::Tensor energy = linkage == kBound ? energy_in->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(dist.scalar_type(), "pullback_ext::agglomerate", [&] {
    const scalar_t* d = dist.const_data_ptr<scalar_t>();
    const scalar_t* s = linkage == kBound ? sizes.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* e = linkage == kBound ? energy.const_data_ptr<scalar_t>() : nullptr;
    int64_t* o = owner.mutable_data_ptr<int64_t>();
    at::parallel_for(0, B, 1, [&](int64_t first, int64_t last) {
      Workspace<scalar_t> w(n, linkage == kAverage || linkage == kBound);
      for (int64_t b = first; b < last; ++b) {
        agglomerate_image(d + b * n * n, s ? s + b * n : nullptr, e ? e + b * n : nullptr, n, count, linkage, w,
                          o + b * n);
      }
    });
  });
  return owner;
}

}  // namespace

}  // namespace cpu
}  // namespace pullback

TORCH_LIBRARY_FRAGMENT(pullback_ext, m) {
  m.set_python_module("pullback_ext.ops");
  m.def("agglomerate(Tensor dist, Tensor? sizes, Tensor? energy, int count, str linkage) -> Tensor");
}

TORCH_LIBRARY_IMPL(pullback_ext, CPU, m) {
  m.impl("agglomerate", &pullback::cpu::agglomerate);
}
