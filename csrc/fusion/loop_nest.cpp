#include "fusion/loop_nest.h"

#include <algorithm>
#include <cstdlib>

namespace kiln::fusion {

LoopNest build_loop_nest(const Kernel& k) {
  std::vector<int> order;
  for (int pass = 0; pass < 2; ++pass)
    for (size_t d = 0; d < k.domain.size(); ++d)
      if (k.reduced[d] == (pass == 1) && k.domain[d] != 1) order.push_back(static_cast<int>(d));
  // Outer loops go in the memory order of the first output (largest stride outermost), so the innermost
  // loop walks it contiguously even when its layout is not the domain's (channels-last, transposed views);
  // pointwise loops may run in any order. Reduced loops keep the domain's order.
  if (!k.stores.empty()) {
    const std::vector<int64_t>& strides = k.stores[0].index.strides;
    const auto outer_end = std::find_if(order.begin(), order.end(), [&](int d) { return k.reduced[d]; });
    std::stable_sort(order.begin(), outer_end, [&](int a, int b) { return std::llabs(strides[a]) > std::llabs(strides[b]); });
  }
  // Bounds predicates and iotas count as accesses: a loop merged across a bounded dim would lose the dim's own index.
  std::vector<const std::vector<int64_t>*> accesses;
  for (const Expr& e : k.exprs) {
    if (Kernel::has_index(e)) accesses.push_back(&e.index.strides);
    for (const Bound& b : e.bounds) accesses.push_back(&b.index.strides);
  }
  for (const auto& s : k.stores) accesses.push_back(&s.index.strides);

  // groups of domain dims merged into one loop (outermost first within a group)
  std::vector<std::vector<int>> groups;
  for (int d : order) {
    if (!groups.empty()) {
      const int inner = groups.back().back();
      bool mergeable = k.reduced[inner] == k.reduced[d];
      for (const auto* s : accesses) mergeable = mergeable && (*s)[inner] == (*s)[d] * k.domain[d];
      if (mergeable) {
        groups.back().push_back(d);
        continue;
      }
    }
    groups.push_back({d});
  }
  LoopNest nest;
  auto merged = [&](const std::vector<int64_t>& strides) {
    std::vector<int64_t> out;
    for (const auto& g : groups) out.push_back(strides[g.back()]);  // the innermost dim's stride steps the loop
    return out;
  };
  for (const auto& g : groups) {
    int64_t size = 1;
    for (int d : g) size *= k.domain[d];
    nest.loops.push_back({size, static_cast<bool>(k.reduced[g[0]])});
    if (!k.reduced[g[0]]) nest.outer_count++;
  }
  nest.load_strides.resize(k.exprs.size());
  nest.bound_strides.resize(k.exprs.size());
  for (size_t i = 0; i < k.exprs.size(); ++i) {
    if (Kernel::has_index(k.exprs[i])) nest.load_strides[i] = merged(k.exprs[i].index.strides);
    for (const Bound& b : k.exprs[i].bounds) nest.bound_strides[i].push_back(merged(b.index.strides));
  }
  for (const auto& s : k.stores) nest.store_strides.push_back(merged(s.index.strides));
  return nest;
}

std::vector<bool> depends_on_reduced_loops(const Kernel& k, const LoopNest& nest) {
  std::vector<bool> depends(k.exprs.size(), false);
  for (size_t i = 0; i < k.exprs.size(); ++i) {
    const Expr& e = k.exprs[i];
    if (e.kind == ExprKind::Reduce) continue;
    if (Kernel::has_index(e)) depends[i] = nest.runs_reduced(nest.load_strides[i]);
    for (const auto& strides : nest.bound_strides[i]) depends[i] = depends[i] || nest.runs_reduced(strides);
    for (int32_t op : e.operands) depends[i] = depends[i] || (op >= 0 && depends[op]);
  }
  return depends;
}

std::vector<bool> uses_reductions(const Kernel& k) {
  std::vector<bool> uses(k.exprs.size(), false);
  for (size_t i = 0; i < k.exprs.size(); ++i) {
    uses[i] = k.exprs[i].kind == ExprKind::Reduce;
    for (int32_t op : k.exprs[i].operands) uses[i] = uses[i] || (op >= 0 && uses[op]);
  }
  return uses;
}

bool LoopNest::runs_reduced(const std::vector<int64_t>& strides) const {
  for (size_t l = 0; l < loops.size(); ++l)
    if (loops[l].reduced && strides[l] != 0) return true;
  return false;
}

int64_t LoopNest::outer_numel() const {
  int64_t n = 1;
  for (int l = 0; l < outer_count; ++l) n *= loops[l].size;
  return n;
}

int64_t LoopNest::reduced_numel() const {
  int64_t n = 1;
  for (size_t l = outer_count; l < loops.size(); ++l) n *= loops[l].size;
  return n;
}

}  // namespace kiln::fusion
