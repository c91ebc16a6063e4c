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

}  // namespace

std::vector<int32_t> in_place_sources(const Kernel& k) {
  std::vector<int32_t> source(k.buffers.size(), -1);
  if (k.has_reduction() || k.window_reduction) return source;
  std::vector<int> store_count(k.buffers.size(), 0);
  for (const Store& st : k.stores) ++store_count[st.buffer];
  std::vector<bool> offered(k.buffers.size(), false);
  for (const Store& st : k.stores) {
    const int32_t out = st.buffer;
    if (store_count[out] != 1 || source[out] >= 0) continue;
    for (size_t in = 0; in < k.buffers.size(); ++in) {
      if (k.buffers[in].is_output || offered[in] || k.buffers[in].dtype != k.buffers[out].dtype) continue;
      bool loaded = false, qualifies = true;
      for (const Expr& x : k.exprs) {
        if (x.kind != ExprKind::Load || x.buffer != static_cast<int32_t>(in)) continue;
        loaded = true;
        qualifies = qualifies && x.operands[0] < 0 && same_index(x.index, st.index);
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
