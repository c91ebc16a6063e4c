// addmm split into mm + a fusable bias add (passes/split_addmm.h).
#include "passes/split_addmm.h"

#include "passes/graph_rewriter.h"

namespace kiln::passes {

using graph::Graph;
using graph::Node;
using graph::TensorArg;
using graph::ValueId;

namespace {

bool is_one(const graph::ArgValue& a) {
  if (const auto* i = std::get_if<int64_t>(&a)) return *i == 1;
  if (const auto* d = std::get_if<double>(&a)) return *d == 1.0;
  return false;
}

// True when `n` is an addmm this pass rewrites.
bool splits(const Graph& g, const Node& n) {
  if (n.qualified_name() != "aten::addmm.default" || n.args.size() != 5 || n.outputs.size() != 1) return false;
  const auto* bias = std::get_if<TensorArg>(&n.args[0]);
  const auto* a = std::get_if<TensorArg>(&n.args[1]);
  const auto* b = std::get_if<TensorArg>(&n.args[2]);
  if (!bias || !a || !b || !is_one(n.args[3]) || !is_one(n.args[4])) return false;
  const graph::TensorMeta& out = g.values[n.outputs[0]].meta;
  const graph::TensorMeta& bm = g.values[bias->id].meta;
  return out.device.type == graph::DeviceType::CUDA && out.dtype == graph::ScalarType::Float &&
         bm.dtype == graph::ScalarType::Float && out.sizes.size() == 2 && bm.sizes.size() == 1 &&
         bm.sizes[0] == out.sizes[1];
}

}  // namespace

bool split_addmm_bias(Graph& g) {
  bool any = false;
  for (const Node& n : g.nodes) any = any || splits(g, n);
  if (!any) return false;
  GraphRewriter rewriter(g);
  for (Node& n : rewriter.take_nodes()) {
    if (!splits(g, n)) {
      rewriter.append(std::move(n));
      continue;
    }
    const ValueId result = n.outputs[0];
    graph::TensorMeta product = g.values[result].meta;
    product.requires_grad = false;
    product.storage_offset = 0;
    const ValueId mm = rewriter.add("aten::mm", "default", {n.args[1], n.args[2]}, {"self", "mat2"}, 2, product);
    const ValueId bias = rewriter.expand(std::get<TensorArg>(n.args[0]).id, product.sizes);
    rewriter.add("aten::add", "Tensor", {TensorArg{mm}, TensorArg{bias}, int64_t{1}}, {"self", "other", "alpha"}, 2,
                 product, false, result);
  }
  return true;
}

}  // namespace kiln::passes
