// In-place candidates of a kernel's outputs (fusion/in_place_outputs.h).
//
// Design: a kernel that reads x[i] and writes y[i] at the same affine index in the same iteration, and reads x
// nowhere else, may write y into x's storage: every generated loop (vectorised, tiled, one CUDA thread per
// element or per vector) loads an iteration's elements before it stores them, and no iteration reads another's
// element. Reductions and guarded (padded, windowed) loads read across iterations and never qualify.
#include "fusion/in_place_outputs.h"

namespace kiln::fusion {

namespace {

bool same_index(const IndexExpr& a, const IndexExpr& b) { return a.offset == b.offset && a.strides == b.strides; }

// The expressions the first `count` stores need (operands come before their users: SSA order).
std::vector<bool> needed_by_stores(const Kernel& k, size_t count) {
  std::vector<bool> needed(k.exprs.size(), false);
  for (size_t s = 0; s < count; ++s) needed[k.stores[s].expr] = true;
  for (size_t e = k.exprs.size(); e-- > 0;)
    if (needed[e])
      for (int32_t operand : k.exprs[e].operands)
        if (operand >= 0) needed[operand] = true;
  return needed;
}

}  // namespace

std::vector<int32_t> in_place_sources(const Kernel& k) {
  std::vector<int32_t> source(k.buffers.size(), -1);
  if (k.has_reduction() || k.window_reduction) return source;
  std::vector<int> store_count(k.buffers.size(), 0);
  for (const Store& st : k.stores) ++store_count[st.buffer];
  std::vector<bool> offered(k.buffers.size(), false);
  for (size_t s = 0; s < k.stores.size(); ++s) {
    const Store& st = k.stores[s];
    const int32_t out = st.buffer;
    if (store_count[out] != 1 || source[out] >= 0) continue;
    // Code generators emit a store's operands right before it, store by store: a load that only a later store
    // needs would run after this store and read the new value.
    const std::vector<bool> emitted = needed_by_stores(k, s + 1);
    for (size_t in = 0; in < k.buffers.size(); ++in) {
      if (k.buffers[in].is_output || offered[in] || k.buffers[in].dtype != k.buffers[out].dtype) continue;
      bool loaded = false, qualifies = true;
      for (size_t e = 0; e < k.exprs.size(); ++e) {
        const Expr& x = k.exprs[e];
        if (x.kind != ExprKind::Load || x.buffer != static_cast<int32_t>(in)) continue;
        loaded = true;
        qualifies = qualifies && x.operands[0] < 0 && x.operands[1] < 0 && same_index(x.index, st.index) && emitted[e];
      }
      if (loaded && qualifies) {
        source[out] = static_cast<int32_t>(in);
        offered[in] = true;
        break;
      }
    }
  }
  return source;
}

}  // namespace kiln::fusion
