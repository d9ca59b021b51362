// merge_step's rules, shared by its CPU (csrc/cpu/merge_step.cpp) and CUDA (csrc/cuda/merge_step.cu)
// kernels: the rule names of the schema, how many tokens a rule merges, and the orders that decide
// its ties (those of the unfused path: torch.argsort(stable=True), torch.max / torch.min, which
// keep the first of equal values; NaN sorts as the largest value, as in torch).
#pragma once

#include <c10/macros/Macros.h>

#include <algorithm>
#include <cstdint>
#include <string>

namespace pullback {

// tome: ToMe's bipartite rule; cosine / bound: importance_tome's guarded costs (lowest first);
// pitome / pitome_protected: PiToMe's energy-ordered split (all patch tokens / the 2R highest).
enum class MergeRule : int { Tome = 0, Cosine = 1, Bound = 2, Pitome = 3, PitomeProtected = 4 };

// The rule named `name`, or -1 for an unknown name.
inline int merge_rule_code(const std::string& name) {
  static const char* const names[] = {"tome", "cosine", "bound", "pitome", "pitome_protected"};
  for (int i = 0; i < 5; ++i) {
    if (name == names[i]) return i;
  }
  return -1;
}

C10_HOST_DEVICE inline bool merge_rule_is_pitome(MergeRule rule) {
  return rule == MergeRule::Pitome || rule == MergeRule::PitomeProtected;
}

C10_HOST_DEVICE inline bool merge_rule_is_guarded(MergeRule rule) {
  return rule == MergeRule::Cosine || rule == MergeRule::Bound;
}

// Tokens one step merges among K tokens of which `prefix` are prefix tokens (never merged):
// PiToMe's min(r, n / 2) of the n patch tokens, else ToMe's r clipped to |A| (0 when B is empty).
inline int64_t merge_step_count(MergeRule rule, int64_t r, int64_t prefix, int64_t K) {
  const int64_t n = K - prefix;
  if (merge_rule_is_pitome(rule)) return std::min(r, n / 2);
  const int64_t size_a = (K + 1) / 2 - (prefix + 1) / 2;
  return n - size_a > 0 ? std::min(r, size_a) : 0;
}

// a before b in a descending sort (NaN first); equal values (NaN with NaN) are neither.
template <typename T>
C10_HOST_DEVICE inline bool merge_greater(T a, T b) {
  return a > b || (a != a && b == b);
}

}  // namespace pullback
