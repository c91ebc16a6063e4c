// Pointwise ops moved past the permuting copy that is their only use (passes/sink_into_copies.h).
//
// Design: the clone's operand e is a view of the op's result y, which is dense and contiguous, so each of e's
// dims j walks y's storage with a stride S_j. Where every S_j is a multiple m_j of one dim k_j's contiguous
// stride and the dims walking the same k stay inside it (splits and permutations do; a view that merges dims
// of y never reaches here, since y is contiguous and a merge would make e contiguous too), e[i] is y at the
// index whose digit k is o_k + sum over j with k_j = k of m_j * i_j (o: e's storage offset as y's digits). An
// operand x, broadcast to y with strides B, is then read at x's offset + sum_k o_k B_k, with stride m_j B_{k_j}
// along e's dim j: one as_strided view of x. The op's result keeps e's strides (dense, as eager's
// TensorIterator makes them for an operand laid out so), and the clone stores it in its own layout.
#include "passes/sink_into_copies.h"

#include <algorithm>
#include <optional>
#include <unordered_set>

#include "decomp/decompositions.h"
#include "graph/op_facts.h"
#include "passes/graph_rewriter.h"

namespace kiln::passes {

using graph::Graph;
using graph::Node;
using graph::NodeIndex;
using graph::TensorArg;
using graph::TensorMeta;
using graph::ValueId;

namespace {

bool sinkable_op(const Node& n) {
  return n.outputs.size() == 1 && !n.mutates_args && graph::op_facts(n.qualified_name()).elementwise_binary;
}

// e's dims as (y's dim, multiple of its contiguous stride), or nullopt when a dim straddles y's dims.
struct DimWalk {
  int k = -1;  // -1: a size-1 dim of e
  int64_t m = 0;
};

std::optional<std::vector<DimWalk>> walks_of(const TensorMeta& e, const TensorMeta& y, std::vector<int64_t>& digits) {
  const std::vector<int64_t> cs = graph::contiguous_strides(y.sizes);
  const int rank = static_cast<int>(y.sizes.size());
  int64_t rest = e.storage_offset;
  digits.assign(rank, 0);
  for (int k = 0; k < rank; ++k) {
    digits[k] = rest / cs[k];
    rest %= cs[k];
  }
  std::vector<DimWalk> walks(e.sizes.size());
  std::vector<int64_t> reach = digits;  // the largest digit each y dim reaches
  for (size_t j = 0; j < e.sizes.size(); ++j) {
    if (e.sizes[j] == 1) continue;
    const int64_t s = e.strides[j];
    int k = rank - 1;
    while (k > 0 && s >= cs[k] * y.sizes[k]) --k;
    if (s <= 0 || s % cs[k] != 0) return std::nullopt;
    walks[j] = {k, s / cs[k]};
    reach[k] += walks[j].m * (e.sizes[j] - 1);
  }
  for (int k = 0; k < rank; ++k)
    if (reach[k] >= y.sizes[k]) return std::nullopt;
  return walks;
}

// Whether strides describe a dense, non-overlapping layout of sizes (a permuted contiguous one), wherever it starts.
bool dense(const TensorMeta& m) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims larger than 1
  for (size_t d = 0; d < m.sizes.size(); ++d)
    if (m.sizes[d] != 1) dims.push_back({m.strides[d], m.sizes[d]});
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (stride != expected) return false;
    expected *= size;
  }
  return true;
}

struct Sink {
  Node op;                     // the pointwise op (a copy: the rewrite appends the original, dead, first)
  ValueId viewed;              // the clone's operand (the end of the view chain)
  std::vector<DimWalk> walks;  // walks_of(viewed, op's result)
  std::vector<int64_t> digits;
};

}  // namespace

bool sink_pointwise_into_copies(Graph& g) {
  std::vector<int> uses(g.values.size(), 0);
  for (const Node& n : g.nodes)
    for (const graph::ArgValue& arg : n.args) graph::for_each_tensor(arg, [&](ValueId v) { ++uses[v]; });
  const std::unordered_set<ValueId> outputs(g.outputs.begin(), g.outputs.end());
  auto single_use = [&](ValueId v) { return uses[v] == 1 && !outputs.count(v); };

  std::vector<std::optional<Sink>> sinks(g.nodes.size());
  bool any = false;
  for (NodeIndex c = 0; c < static_cast<NodeIndex>(g.nodes.size()); ++c) {
    const Node& clone = g.nodes[c];
    if (clone.qualified_name() != "aten::clone.default" || clone.outputs.size() != 1) continue;
    const auto* operand = std::get_if<TensorArg>(&clone.args.at(0));
    if (!operand) continue;
    const TensorMeta& out = g.value(clone.outputs[0]).meta;
    if (out.strides != graph::contiguous_strides(out.sizes)) continue;
    // back through the views to the op
    ValueId cur = operand->id;
    int views = 0;
    while (single_use(cur) && g.value(cur).producer >= 0) {
      const Node& p = g.nodes[g.value(cur).producer];
      if (!decomp::is_affine_view(g, p)) break;
      cur = std::get<TensorArg>(p.args[0]).id;
      ++views;
    }
    if (views == 0 || !single_use(cur) || g.value(cur).producer < 0) continue;
    const NodeIndex op = g.value(cur).producer;
    const TensorMeta& y = g.value(cur).meta;
    const TensorMeta& e = g.value(operand->id).meta;
    if (!sinkable_op(g.nodes[op]) || y.storage_offset != 0 || y.strides != graph::contiguous_strides(y.sizes) || !dense(e)) continue;
    std::vector<int64_t> digits;
    std::optional<std::vector<DimWalk>> walks = walks_of(e, y, digits);
    if (!walks) continue;
    sinks[c] = Sink{g.nodes[op], operand->id, std::move(*walks), std::move(digits)};
    any = true;
  }
  if (!any) return false;

  GraphRewriter rewriter(g);
  std::vector<Node> nodes = rewriter.take_nodes();
  for (NodeIndex c = 0; c < static_cast<NodeIndex>(nodes.size()); ++c) {
    if (sinks[c]) {
      const Node& op = sinks[c]->op;
      const std::vector<DimWalk>& walks = sinks[c]->walks;
      const std::vector<int64_t>& digits = sinks[c]->digits;
      const TensorMeta y = g.value(op.outputs[0]).meta;
      const TensorMeta e = g.value(sinks[c]->viewed).meta;
      std::vector<graph::ArgValue> args = op.args;
      for (graph::ArgValue& arg : args) {
        auto* t = std::get_if<TensorArg>(&arg);
        if (!t) continue;
        TensorMeta x = g.value(t->id).meta;
        const std::vector<int64_t> b = graph::broadcast_strides(x, y.sizes);
        int64_t offset = x.storage_offset;
        for (size_t k = 0; k < y.sizes.size(); ++k) offset += digits[k] * b[k];
        std::vector<int64_t> strides(e.sizes.size(), 0);
        for (size_t j = 0; j < e.sizes.size(); ++j)
          if (walks[j].k >= 0) strides[j] = walks[j].m * b[walks[j].k];
        x.sizes = e.sizes;
        x.strides = strides;
        x.storage_offset = offset;
        x.requires_grad = false;
        t->id = rewriter.add("aten::as_strided", "default", {TensorArg{t->id}, e.sizes, strides, offset},
                             {"self", "size", "stride", "storage_offset"}, 4, x, true);
      }
      TensorMeta result = y;
      result.sizes = e.sizes;
      result.strides = e.strides;  // dense (checked): what eager's TensorIterator gives an operand laid out so
      result.requires_grad = false;
      const ValueId sunk = rewriter.add(op.op, op.overload, std::move(args), op.arg_names, op.num_positional, result);
      std::get<TensorArg>(nodes[c].args[0]).id = sunk;
    }
    rewriter.append(std::move(nodes[c]));
  }
  return true;
}

}  // namespace kiln::passes
