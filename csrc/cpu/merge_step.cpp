// CPU kernel of merge_step (one merge of ToMe's loop: the ranking of its rule and the size-weighted
// merge with every map merge-and-restore needs), its schema and its CPU registration.
//
// One image per at::parallel_for task. The ranking scores in double; only its decisions reach the
// outputs, and they are taken as the unfused path takes them (csrc/merge_step.h). The merge adds
// up exactly as merge_tokens's CPU kernel does (csrc/cpu/tokens.cpp), so that the fused and the
// unfused step are bitwise equal: weights summed in double in the order of the sources, each row
// c_d x_d + Σ c_s x_s with c = w / total rounded to the tokens' dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>
#include <vector>

#include "invariants.h"
#include "merge_step.h"

namespace pullback {
namespace cpu {

namespace {

// The decisions of one image: order[K] (the current index at each position of the reordered
// sequence), src[R] and dst[R] (positions in it: src[j] merges into dst[j]).
struct StepPlan {
  std::vector<int64_t> order, src, dst;
};

// Unit head-mean keys [K, hd] of image b (torch.nn.functional.normalize's eps = 1e-12). `keys`:
// the image's [H, K, hd] keys, its last dimension of unit stride. The head sum is normalised
// directly (the mean's direction; the eps scaled by H to match), by one reciprocal per row.
template <typename T>
std::vector<double> unit_keys(const at::TensorAccessor<T, 3>& keys) {
  const int64_t H = keys.size(0), K = keys.size(1), hd = keys.size(2);
  std::vector<double> m(K * hd, 0.0);
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t t = 0; t < K; ++t) {
      const T* key = keys[h][t].data();
      double* row = m.data() + t * hd;
      for (int64_t d = 0; d < hd; ++d) row[d] += static_cast<double>(key[d]);
    }
  }
  for (int64_t t = 0; t < K; ++t) {
    double* row = m.data() + t * hd;
    double partial[4] = {};  // four running sums: the adds of one do not wait on each other
    for (int64_t d = 0; d < hd; ++d) partial[d % 4] += row[d] * row[d];
    const double norm = (partial[0] + partial[1]) + (partial[2] + partial[3]);
    const double inverse = 1.0 / std::max(std::sqrt(norm), 1e-12 * static_cast<double>(H));
    for (int64_t d = 0; d < hd; ++d) row[d] *= inverse;
  }
  return m;
}

// x^y as torch's pow(Tensor, Scalar) computes it (its exact special cases, then std::pow).
double torch_pow(double x, double y) {
  if (y == 0.0) return 1.0;
  if (y == 1.0) return x;
  if (y == 0.5) return std::sqrt(x);
  if (y == 2.0) return x * x;
  if (y == 3.0) return x * x * x;
  return std::pow(x, y);
}

// out[i * |cols| + j] = <m[rows[i]], m[cols[j]]> for rows of length hd of m: the rows gathered,
// then one double matrix product (BLAS), as the unfused path takes its cosines.
void cross_dots(const std::vector<double>& m, int64_t hd, const std::vector<int64_t>& rows,
                const std::vector<int64_t>& cols, std::vector<double>& out) {
  const int64_t nr = static_cast<int64_t>(rows.size()), nc = static_cast<int64_t>(cols.size());
  out.assign(nr * nc, 0.0);
  if (nr == 0 || nc == 0 || hd == 0) return;
  std::vector<double> a(nr * hd), b(nc * hd);
  for (int64_t i = 0; i < nr; ++i) std::copy_n(m.data() + rows[i] * hd, hd, a.data() + i * hd);
  for (int64_t j = 0; j < nc; ++j) std::copy_n(m.data() + cols[j] * hd, hd, b.data() + j * hd);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  at::Tensor product = at::from_blob(out.data(), {nr, nc}, f64);
  at::mm_out(product, at::from_blob(a.data(), {nr, hd}, f64), at::from_blob(b.data(), {nc, hd}, f64).t());
}

// `values` sorted (stable; descending, or ascending with `ascending`): the indices 0..n-1.
std::vector<int64_t> stable_ranking(const std::vector<double>& values, bool ascending) {
  std::vector<int64_t> idx(values.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) {
    return ascending ? merge_greater(values[b], values[a]) : merge_greater(values[a], values[b]);
  });
  return idx;
}

// The first index of the largest (`largest`) or smallest of values[0..n), n >= 1, in merge_greater's
// order (NaN the largest), as a scan keeping the first of equal values finds it: four lanes scan
// every fourth value (their compares independent), then the lanes' bests are merged, ties to the
// lower index.
template <bool largest>
int64_t first_extreme(const double* values, int64_t n) {
  const auto before = [](double a, double b) { return largest ? merge_greater(a, b) : merge_greater(b, a); };
  int64_t lane_best[4] = {0, 1, 2, 3};
  for (int64_t j = 4; j < n; ++j) {
    int64_t& at = lane_best[j % 4];
    if (before(values[j], values[at])) at = j;
  }
  int64_t best = lane_best[0];
  for (int64_t l = 1; l < 4 && l < n; ++l) {
    const int64_t j = lane_best[l];
    if (before(values[j], values[best]) || (!before(values[best], values[j]) && j < best)) best = j;
  }
  return best;
}

// PiToMe's order [prefix, protected, A, B] from the energies of the patch tokens; sets a_start, size_a.
std::vector<int64_t> energy_order(const std::vector<double>& m, int64_t hd, int64_t K, int64_t p, int64_t count,
                                  bool protect, double margin, double alpha, int64_t& a_start, int64_t& size_a) {
  const int64_t n = K - p;
  std::vector<int64_t> patches(n);
  std::iota(patches.begin(), patches.end(), p);
  std::vector<double> cos;
  cross_dots(m, hd, patches, patches, cos);
  std::vector<double> energy(n);
  for (int64_t i = 0; i < n; ++i) {
    double total = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      const double v = cos[i * n + j] - margin;
      total += v > 0 ? v : alpha * std::expm1(v);
    }
    energy[i] = total / static_cast<double>(n);
  }
  const std::vector<int64_t> ranked = stable_ranking(energy, false);
  const int64_t candidates = protect ? 2 * count : n;
  std::vector<int64_t> order(K);
  std::iota(order.begin(), order.begin() + p, 0);
  int64_t at = p;
  for (int64_t i = candidates; i < n; ++i) order[at++] = ranked[i] + p;
  for (int64_t i = 0; i < candidates; i += 2) order[at++] = ranked[i] + p;
  for (int64_t i = 1; i < candidates; i += 2) order[at++] = ranked[i] + p;
  a_start = p + n - candidates;
  size_a = (candidates + 1) / 2;
  return order;
}

// The decisions of `rule` on image b's unit keys m, sizes s and energies e (both [K], current order).
StepPlan rank_image(MergeRule rule, const std::vector<double>& m, int64_t hd, const std::vector<double>& s,
                    const std::vector<double>& e, int64_t K, int64_t p, int64_t count, double guard, double margin,
                    double alpha) {
  StepPlan plan;
  int64_t a_start = p, size_a = 0;
  if (merge_rule_is_pitome(rule)) {
    plan.order = energy_order(m, hd, K, p, count, rule == MergeRule::PitomeProtected, margin, alpha, a_start, size_a);
  } else {  // ToMe's split: [prefix, even positions, odd positions]
    plan.order.resize(K);
    std::iota(plan.order.begin(), plan.order.begin() + p, 0);
    int64_t at = p;
    for (int64_t t = p + p % 2; t < K; t += 2) plan.order[at++] = t;
    size_a = at - p;
    for (int64_t t = p + 1 - p % 2; t < K; t += 2) plan.order[at++] = t;
  }
  const int64_t b_start = a_start + size_a, size_b = K - b_start;
  std::vector<double> cosines;
  cross_dots(m, hd, std::vector<int64_t>(plan.order.begin() + a_start, plan.order.begin() + b_start),
             std::vector<int64_t>(plan.order.begin() + b_start, plan.order.end()), cosines);
  std::vector<double> score(size_a);
  std::vector<int64_t> match(size_a);
  // the B side's sizes and energies in B's order, so that a row of pair costs reads them contiguously
  const bool bound = rule == MergeRule::Bound;
  std::vector<double> s_b(bound ? size_b : 0), e_b(bound ? size_b : 0), costs(bound ? size_b : 0);
  for (int64_t j = 0; bound && j < size_b; ++j) {
    s_b[j] = s[plan.order[b_start + j]];
    e_b[j] = e[plan.order[b_start + j]];
  }
  for (int64_t i = 0; i < size_a; ++i) {
    const int64_t a = plan.order[a_start + i];
    // tome, pitome, cosine: the largest cosine; bound: the smallest cost (the first of equal values)
    const double* row = cosines.data() + i * size_b;
    if (bound) {  // branch-free passes over the row, so that they vectorise
      const double sa = s[a], ea = e[a];
      for (int64_t j = 0; j < size_b; ++j) {
        const double total = sa + s_b[j];
        costs[j] = (ea * (s_b[j] * s_b[j]) + e_b[j] * (sa * sa)) / (total * total);
      }
      if (guard == 1.0) {  // the default: torch_pow's x^0.5 is its sqrt
        for (int64_t j = 0; j < size_b; ++j) costs[j] = std::sqrt(costs[j]) * std::sqrt(std::max(2.0 - 2.0 * row[j], 0.0));
      } else {
        for (int64_t j = 0; j < size_b; ++j) costs[j] = torch_pow(costs[j], guard / 2) * std::sqrt(std::max(2.0 - 2.0 * row[j], 0.0));
      }
      row = costs.data();
    }
    const int64_t best_j = bound ? first_extreme<false>(row, size_b) : first_extreme<true>(row, size_b);
    const double best = row[best_j];
    match[i] = b_start + best_j;
    score[i] = rule == MergeRule::Cosine ? torch_pow(e[a], guard / 2) * (1.0 - best) : best;
  }
  const std::vector<int64_t> chosen = stable_ranking(score, merge_rule_is_guarded(rule));
  for (int64_t j = 0; j < count; ++j) {
    plan.src.push_back(a_start + chosen[j]);
    plan.dst.push_back(match[chosen[j]]);
  }
  return plan;
}

// Merged-sequence slots of image b: slot[pos] for every position of the reordered sequence (a
// merged-away one: its destination's), kept[m] the position in slot m, members[m] its sources in
// the order of src.
struct Slots {
  std::vector<int64_t> slot, kept;
  std::vector<std::vector<int64_t>> members;
};

Slots merge_slots(const StepPlan& plan, int64_t K) {
  Slots out;
  const int64_t R = static_cast<int64_t>(plan.src.size());
  out.slot.assign(K, 0);
  for (const int64_t s : plan.src) out.slot[s] = -1;
  for (int64_t pos = 0; pos < K; ++pos) {
    if (out.slot[pos] < 0) continue;
    out.slot[pos] = static_cast<int64_t>(out.kept.size());
    out.kept.push_back(pos);
  }
  out.members.resize(out.kept.size());
  for (int64_t j = 0; j < R; ++j) out.members[out.slot[plan.dst[j]]].push_back(plan.src[j]);
  for (int64_t j = 0; j < R; ++j) out.slot[plan.src[j]] = out.slot[plan.dst[j]];
  return out;
}

// merge_tokens's arithmetic (csrc/cpu/tokens.cpp) on one output row of the reordered sequence:
// the merged weight, and the row itself unless `row` is null. Position t of the sequence is row
// order[t] of x [K, D]; w [K] is already in the sequence's order.
template <typename T, typename W>
W merged_row(const T* x, const int64_t* order, int64_t D, const W* w, int64_t t, const std::vector<int64_t>& sources,
             T* row) {
  double total = static_cast<double>(w[t]);
  for (const int64_t s : sources) total += static_cast<double>(w[s]);
  if (row == nullptr) return static_cast<W>(total);
  const T* xt = x + order[t] * D;
  if (sources.empty() || total == 0.0) {
    std::copy(xt, xt + D, row);
    return static_cast<W>(total);
  }
  const T c0 = static_cast<T>(static_cast<double>(w[t]) / total);
  for (int64_t d = 0; d < D; ++d) row[d] = c0 * xt[d];
  for (const int64_t s : sources) {
    const T cs = static_cast<T>(static_cast<double>(w[s]) / total);
    const T* xs = x + order[s] * D;
    for (int64_t d = 0; d < D; ++d) row[d] += cs * xs[d];
  }
  return static_cast<W>(total);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_step(
    const at::Tensor& x_in, const at::Tensor& keys_in, const std::optional<at::Tensor>& sizes_in,
    const std::optional<at::Tensor>& energy_in, const std::optional<at::Tensor>& owner_in,
    const std::optional<at::Tensor>& positions_in, int64_t num_prefix, int64_t r, std::string rule_name,
    double guard, double margin, double alpha) {
  constexpr const char* op = "merge_step";
  const int code = merge_rule_code(rule_name);
  expect_that(code >= 0, op, "unknown rule ", rule_name);
  const MergeRule rule = static_cast<MergeRule>(code);
  expect_tensor(op, x_in, "x", {-1, -1, -1}, x_in.device(), x_in.scalar_type());
  const int64_t B = x_in.size(0), K = x_in.size(1), D = x_in.size(2);
  expect_that(0 <= num_prefix && num_prefix <= K && r >= 0, op, "num_prefix = ", num_prefix, ", r = ", r);
  expect_tensor(op, keys_in, "keys", {B, -1, K, -1}, x_in.device(), x_in.scalar_type());
  const bool has_sizes = sizes_in.has_value() && sizes_in->defined();
  const bool has_energy = energy_in.has_value() && energy_in->defined();
  const bool has_owner = owner_in.has_value() && owner_in->defined();
  const bool has_positions = positions_in.has_value() && positions_in->defined();
  if (has_sizes) expect_tensor(op, *sizes_in, "sizes", {B, K}, x_in.device(), x_in.scalar_type());
  if (has_energy) expect_tensor(op, *energy_in, "energy", {B, K}, x_in.device(), x_in.scalar_type());
  expect_that(has_energy || !merge_rule_is_guarded(rule), op, "rule ", rule_name, " needs energy");
  if (has_owner) expect_tensor(op, *owner_in, "owner", {B, -1}, x_in.device(), at::kLong);
  if (has_positions) expect_tensor(op, *positions_in, "positions", {B, K}, x_in.device(), at::kLong);

  const at::Tensor x = x_in.contiguous();
  const at::Tensor sizes = has_sizes ? sizes_in->contiguous() : at::ones({B, K}, x.options());
  const at::Tensor energy = has_energy ? energy_in->contiguous() : at::Tensor();
  const at::Tensor owner = has_owner ? owner_in->contiguous() : at::Tensor();
  const at::Tensor positions = has_positions ? positions_in->contiguous() : at::Tensor();
  const int64_t R = merge_step_count(rule, r, num_prefix, K), M = K - R;
  const int64_t N = has_owner ? owner.size(1) : K;
  at::Tensor x_out = at::empty({B, M, D}, x.options());
  at::Tensor sizes_out = at::empty({B, M}, x.options());
  at::Tensor energy_out = has_energy ? at::empty({B, M}, x.options()) : at::empty({0}, x.options());
  at::Tensor owner_out = at::empty({B, N}, x.options().dtype(at::kLong));
  at::Tensor positions_out = at::empty({B, M}, x.options().dtype(at::kLong));

  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "merge_step_cpu", [&] {
    const at::Tensor unit_stride_keys = keys_in.stride(3) == 1 ? keys_in : keys_in.contiguous();
    const auto keys = unit_stride_keys.accessor<scalar_t, 4>();
    const scalar_t* xs = x.const_data_ptr<scalar_t>();
    const scalar_t* ss = sizes.const_data_ptr<scalar_t>();
    const scalar_t* es = has_energy ? energy.const_data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, B, 1, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) {
        std::vector<double> s(K), e(has_energy ? K : 0);
        for (int64_t t = 0; t < K; ++t) s[t] = static_cast<double>(ss[b * K + t]);
        for (int64_t t = 0; t < static_cast<int64_t>(e.size()); ++t) e[t] = static_cast<double>(es[b * K + t]);
        StepPlan plan;
        if (R > 0) {
          const std::vector<double> m = unit_keys<scalar_t>(keys[b]);
          plan = rank_image(rule, m, keys.size(3), s, e, K, num_prefix, R, guard, margin, alpha);
        } else {
          plan.order.resize(K);
          std::iota(plan.order.begin(), plan.order.end(), 0);
        }
        const Slots slots = merge_slots(plan, K);
        // the sizes and energies gathered into the reordered sequence, then the tokens merged
        std::vector<scalar_t> w(K), ew(has_energy ? K : 0);
        for (int64_t pos = 0; pos < K; ++pos) {
          const int64_t t = plan.order[pos];
          w[pos] = ss[b * K + t];
          if (has_energy) ew[pos] = es[b * K + t];
        }
        const scalar_t* xb = xs + b * K * D;
        scalar_t* xo = x_out.mutable_data_ptr<scalar_t>() + b * M * D;
        for (int64_t j = 0; j < M; ++j) {
          const int64_t pos = slots.kept[j];
          sizes_out.mutable_data_ptr<scalar_t>()[b * M + j] = merged_row<scalar_t, scalar_t>(
              xb, plan.order.data(), D, w.data(), pos, slots.members[j], xo + j * D);
          if (has_energy) {
            energy_out.mutable_data_ptr<scalar_t>()[b * M + j] = merged_row<scalar_t, scalar_t>(
                nullptr, nullptr, D, ew.data(), pos, slots.members[j], nullptr);
          }
          const int64_t place = plan.order[pos];
          positions_out.mutable_data_ptr<int64_t>()[b * M + j] =
              has_positions ? positions.const_data_ptr<int64_t>()[b * K + place] : place;
        }
        std::vector<int64_t> new_index(K);
        for (int64_t pos = 0; pos < K; ++pos) new_index[plan.order[pos]] = slots.slot[pos];
        int64_t* oo = owner_out.mutable_data_ptr<int64_t>() + b * N;
        for (int64_t n = 0; n < N; ++n) {
          const int64_t t = has_owner ? owner.const_data_ptr<int64_t>()[b * N + n] : n;
          oo[n] = t >= 0 && t < K ? new_index[t] : -1;  // an unchecked owner out of range: -1
        }
      }
    });
  });
  return {x_out, sizes_out, energy_out, owner_out, positions_out};
}

}  // namespace

}  // namespace cpu
}  // namespace pullback

TORCH_LIBRARY_FRAGMENT(pullback_ext, m) {
  m.set_python_module("pullback_ext.ops");
  m.def(
      "merge_step(Tensor x, Tensor keys, Tensor? sizes, Tensor? energy, Tensor? owner, Tensor? positions, "
      "int num_prefix, int r, str rule, float guard, float margin, float alpha) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pullback_ext, CPU, m) {
  m.impl("merge_step", &pullback::cpu::merge_step);
}
