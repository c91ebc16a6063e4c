// addmm split into mm + a fusable bias add (passes/split_addmm.h).
//
// Design: for each qualifying addmm, the value the bias add must define is the addmm's result, or, when its
// only use is a reshaping view (F.linear on a 3-d input records addmm on the flattened rows, then a view back
// to 3-d), that view's result: the add then runs in the shape its consumers see, so fusion (which matches
// kernel domains by shape) puts it in their kernel. The addmm is split when some consumer of that value becomes
// generated code (the add is then free), or when the product is small enough that cuBLASLt's tile choice
// leaves SMs idle (measured below); otherwise the bias stays in cuBLASLt's epilogue, which costs nothing.
#include "passes/split_addmm.h"

#include <unordered_map>
#include <unordered_set>

#include "decomp/decompositions.h"
#include "graph/op_facts.h"
#include "passes/graph_rewriter.h"

namespace kiln::passes {

using graph::Graph;
using graph::Node;
using graph::NodeIndex;
using graph::TensorArg;
using graph::ValueId;

namespace {

// bert-base's 1024x768 products ran 71 us with the bias epilogue and 54 us as a plain GEMM on an H200 (132
// SMs): cuBLASLt picked 128x64 tiles, 96 of them. Products with fewer elements than one such tile per SM are
// split even when the add runs alone; transformer6's 4096x1536 ones were as fast either way.
constexpr int64_t kLtTileElements = 128 * 64;


bool qualifies(const Graph& g, const Node& n) {
  if (n.qualified_name() != "aten::addmm.default" || n.args.size() != 5 || n.outputs.size() != 1) return false;
  const auto* bias = std::get_if<TensorArg>(&n.args[0]);
  const auto* a = std::get_if<TensorArg>(&n.args[1]);
  const auto* b = std::get_if<TensorArg>(&n.args[2]);
  if (!bias || !a || !b || !graph::is_number(n.args[3], 1) || !graph::is_number(n.args[4], 1)) return false;
  const graph::TensorMeta& out = g.values[n.outputs[0]].meta;
  const graph::TensorMeta& bm = g.values[bias->id].meta;
  return out.device.type == graph::DeviceType::CUDA && out.dtype == graph::ScalarType::Float &&
         bm.dtype == graph::ScalarType::Float && out.sizes.size() == 2 && bm.sizes.size() == 1 &&
         bm.sizes[0] == out.sizes[1] && out.strides == graph::contiguous_strides(out.sizes);
}

bool is_reshape(const Node& n) { return graph::op_facts(n.qualified_name()).reshape == graph::OpReshape::kView; }

struct Split {
  NodeIndex tail = -1;  // the reshaping view whose result the add defines, or -1
  ValueId result;       // the value the add defines
};

class Splitter {
 public:
  Splitter(Graph& g, int64_t multiprocessors) : g_(g), multiprocessors_(multiprocessors), uses_(g.values.size()) {
    for (NodeIndex i = 0; i < static_cast<NodeIndex>(g.nodes.size()); ++i)
      for (const graph::ArgValue& arg : g.nodes[i].args) graph::for_each_tensor(arg, [&](ValueId v) { uses_[v].push_back(i); });
    outputs_.insert(g.outputs.begin(), g.outputs.end());
  }

  bool run() {
    for (NodeIndex i = 0; i < static_cast<NodeIndex>(g_.nodes.size()); ++i)
      if (qualifies(g_, g_.nodes[i]))
        if (auto split = plan(i)) splits_[i] = *split;
    if (splits_.empty()) return false;
    std::unordered_set<NodeIndex> tails;
    for (const auto& [i, split] : splits_)
      if (split.tail >= 0) tails.insert(split.tail);
    GraphRewriter rewriter(g_);
    std::vector<Node> nodes = rewriter.take_nodes();
    for (NodeIndex i = 0; i < static_cast<NodeIndex>(nodes.size()); ++i) {
      if (tails.count(i)) continue;  // its result is defined by the add of the addmm it reshapes
      auto it = splits_.find(i);
      if (it == splits_.end()) {
        rewriter.append(std::move(nodes[i]));
        continue;
      }
      emit(rewriter, nodes, nodes[i], it->second);
    }
    return true;
  }

 private:
  std::optional<Split> plan(NodeIndex i) {
    const Node& n = g_.nodes[i];
    Split split{-1, n.outputs[0]};
    const auto& uses = uses_[n.outputs[0]];
    if (uses.size() == 1 && !outputs_.count(n.outputs[0]) && is_reshape(g_.nodes[uses[0]])) {
      split.tail = uses[0];
      split.result = g_.nodes[uses[0]].outputs[0];
    }
    bool fused = false;
    for (NodeIndex use : uses_[split.result]) {
      const Node& consumer = g_.nodes[use];
      fused = fused || (!consumer.is_view && decomp::find_decomposition(g_, consumer) != nullptr);
    }
    const auto& sizes = g_.values[n.outputs[0]].meta.sizes;
    const bool small = sizes[0] * sizes[1] < multiprocessors_ * kLtTileElements;
    if (!fused && !small) return std::nullopt;
    return split;
  }

  void emit(GraphRewriter& rewriter, const std::vector<Node>& nodes, const Node& n, const Split& split) {
    graph::TensorMeta product = g_.values[n.outputs[0]].meta;
    product.requires_grad = false;
    product.storage_offset = 0;
    ValueId mm = rewriter.add("aten::mm", "default", {n.args[1], n.args[2]}, {"self", "mat2"}, 2, product);
    graph::TensorMeta shaped = g_.values[split.result].meta;
    shaped.requires_grad = false;
    if (split.tail >= 0) {
      const Node& view = nodes[split.tail];
      graph::ArgValue size = view.args.size() > 1 ? view.args[1] : graph::ArgValue{shaped.sizes};
      mm = rewriter.add("aten::view", "default", {TensorArg{mm}, size}, {"self", "size"}, 2, shaped, true);
    }
    const ValueId bias = rewriter.expand(std::get<TensorArg>(n.args[0]).id, shaped.sizes);
    rewriter.add("aten::add", "Tensor", {TensorArg{mm}, TensorArg{bias}, int64_t{1}}, {"self", "other", "alpha"}, 2,
                 shaped, false, split.result);
  }

  Graph& g_;
  const int64_t multiprocessors_;
  std::vector<std::vector<NodeIndex>> uses_;
  std::unordered_set<ValueId> outputs_;
  std::unordered_map<NodeIndex, Split> splits_;
};

}  // namespace

bool split_addmm_bias(Graph& g, int64_t multiprocessors) { return Splitter(g, multiprocessors).run(); }

}  // namespace kiln::passes
