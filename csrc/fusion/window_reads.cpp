#include "fusion/window_reads.h"

#include <algorithm>
#include <map>
#include <set>

#include "common/error.h"

namespace kiln::fusion {

IndexExpr WindowMap::compose(const IndexExpr& source) const {
  KILN_ASSERT_EQ(source.strides.size(), dims.size()) << "a windowed read's index has the wrong rank";
  IndexExpr out;
  out.offset = source.offset;
  out.strides.assign(domain.size(), 0);
  for (size_t p = 0; p < dims.size(); ++p) {
    const int64_t s = source.strides[p];
    if (s == 0) continue;
    const decomp::DimAccess& a = dims[p];
    out.offset += s * a.offset;
    if (out_dims[p] >= 0) out.strides[out_dims[p]] += s * a.stride;
    if (a.window_dim >= 0) out.strides[window_dims[a.window_dim]] += s * a.dilation;
  }
  return out;
}

std::vector<bool> WindowMap::bounded_dims(const std::vector<int64_t>& extents) const {
  std::vector<bool> bounded(dims.size(), false);
  for (size_t p = 0; p < dims.size(); ++p) {
    const decomp::DimAccess& a = dims[p];
    const int64_t outputs = out_dims[p] >= 0 ? domain[out_dims[p]] : 1;
    const int64_t window = a.window_dim >= 0 ? domain[window_dims[a.window_dim]] : 1;
    if (outputs == 0 || window == 0) continue;  // an empty domain reads nothing
    const int64_t along_out = a.stride * (outputs - 1), along_window = a.dilation * (window - 1);
    const int64_t lowest = a.offset + std::min<int64_t>(0, along_out) + std::min<int64_t>(0, along_window);
    const int64_t highest = a.offset + std::max<int64_t>(0, along_out) + std::max<int64_t>(0, along_window);
    bounded[p] = lowest < 0 || highest >= extents[p];
  }
  return bounded;
}

std::vector<Bound> WindowMap::bounds(const std::vector<int64_t>& extents) const {
  const std::vector<bool> bounded = bounded_dims(extents);
  std::vector<Bound> out;
  for (size_t p = 0; p < dims.size(); ++p) {
    if (!bounded[p]) continue;
    IndexExpr unit;
    unit.strides.assign(dims.size(), 0);
    unit.strides[p] = 1;
    out.push_back({compose(unit), extents[p]});
  }
  return out;
}

int recompute_size(const Kernel& from, int32_t root) {
  std::set<int32_t> seen;
  std::vector<int32_t> todo{root};
  while (!todo.empty()) {
    const int32_t e = todo.back();
    todo.pop_back();
    if (!seen.insert(e).second) continue;
    if (from.exprs[e].kind == ExprKind::Reduce || Kernel::is_gathered(from.exprs[e])) return -1;
    for (int32_t op : from.exprs[e].operands)
      if (op >= 0) todo.push_back(op);
  }
  return static_cast<int>(seen.size());
}

int32_t recompute_through(const Kernel& from, int32_t root, const WindowMap& map, const std::vector<bool>& bounded,
                          int32_t guard, const AddExpr& add, const BufferFor& buffer) {
  std::map<int32_t, int32_t> copies;
  std::function<int32_t(int32_t)> copy = [&](int32_t e) -> int32_t {
    if (auto it = copies.find(e); it != copies.end()) return it->second;
    Expr x = from.exprs[e];  // a copy: `from` may grow while its operands are copied
    KILN_ASSERT(x.kind != ExprKind::Reduce) << "a reduction cannot be recomputed per window element";
    for (int32_t& op : x.operands)
      if (op >= 0) op = copy(op);
    for (Bound& b : x.bounds) b.index = map.compose(b.index);
    if (x.kind == ExprKind::Iota) x.index = map.compose(x.index);  // the producer's element the window reads
    if (x.kind == ExprKind::Load) {
      bool moves = false;  // along a dim whose index can leave the source
      for (size_t p = 0; p < bounded.size(); ++p) moves = moves || (bounded[p] && x.index.strides[p] != 0);
      x.index = map.compose(x.index);
      const graph::ValueId value = from.buffers[x.buffer].value;
      x.buffer = buffer(value);
      if (moves && x.operands[0] < 0) {
        x.operands[0] = guard;
        x.constant = 0;
      } else if (moves) {
        Expr both{ExprKind::Binary, graph::ScalarType::Bool};
        both.op = decomp::PrimOp::LogicalAnd;
        both.operands[0] = guard;
        both.operands[1] = x.operands[0];
        x.operands[0] = add(std::move(both));
      }
    }
    const int32_t copied = add(std::move(x));
    copies[e] = copied;
    return copied;
  };
  return copy(root);
}

}  // namespace kiln::fusion
