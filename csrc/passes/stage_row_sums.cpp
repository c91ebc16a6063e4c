// Row sums of flattened views taken over the unflattened value (passes/stage_row_sums.h).
#include "passes/stage_row_sums.h"

#include <algorithm>
#include <optional>
#include <unordered_map>

#include "decomp/decompositions.h"
#include "graph/op_facts.h"
#include "passes/graph_rewriter.h"

namespace kiln::passes {

using graph::Graph;
using graph::Node;
using graph::NodeIndex;
using graph::ScalarType;
using graph::TensorArg;
using graph::ValueId;

namespace {

// Fewer rows than this per first-stage output and one sum is as good: the second stage would add a launch.
constexpr int64_t kMinStageRows = 16;

struct Plan {
  ValueId base;     // x: the value the view flattens, or the summed value itself
  int leading = 0;  // m: x's leading dims summed (that the view's dim 0 merges)
  bool direct = false;  // the sum is over x itself (no flattening view)
};

// Whether fusion would likely put `v` in a kernel that already reduces (over other dims: a layer norm's gradient
// added to the residual's), following the decomposed, non-view producers that kernel grows from. Then the first
// stage could not join it, and one sum over the flattened rows (no second launch) is better.
bool computed_with_a_reduction(const Graph& g, ValueId v, int depth = 0) {
  const NodeIndex p = g.values[v].producer;
  if (p < 0 || depth > 8) return false;
  const Node& n = g.nodes[p];
  if (n.is_view) return false;
  const decomp::Decomposition* d = decomp::find_decomposition(g, n);
  if (!d) return false;  // an extern call's result is a tensor: the sum loads it
  if (d->reduction_dims || d->window_sizes) return true;
  bool found = false;
  for (const graph::ArgValue& arg : n.args)
    graph::for_each_tensor(arg, [&](ValueId a) { found = found || computed_with_a_reduction(g, a, depth + 1); });
  return found;
}

bool is_flattening_view(const Node& n) {
  return graph::op_facts(n.qualified_name()).reshape != graph::OpReshape::kNone && n.outputs.size() == 1 &&
         !n.args.empty() && std::holds_alternative<TensorArg>(n.args[0]);
}

// x can share a kernel with a sum over its rows: it is made by decomposed ops, none of them a reduction.
bool fusable_producer(const Graph& g, ValueId x) {
  const NodeIndex producer = g.values[x].producer;
  return producer >= 0 && !g.nodes[producer].is_view && decomp::find_decomposition(g, g.nodes[producer]) &&
         !computed_with_a_reduction(g, x);
}

bool floating(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Double || t == ScalarType::Half || t == ScalarType::BFloat16;
}

// Two stages pay where the first has d0 >= 2 blocks of at least kMinStageRows rows; half types keep one rounding.
bool two_stages(const graph::TensorMeta& base, int leading) {
  int64_t inner_rows = 1;
  for (int d = 1; d < leading; ++d) inner_rows *= base.sizes[d];
  return (base.dtype == ScalarType::Float || base.dtype == ScalarType::Double) && base.sizes[0] >= 2 &&
         inner_rows >= kMinStageRows;
}

// `alongside`: the sum joins a neighbouring staged sum's first-stage kernel instead of its value's (a layer norm's
// bias gradient, summed from the incoming gradient next to its weight gradient).
std::optional<Plan> plan(const Graph& g, const Node& n, bool alongside = false) {
  if (n.qualified_name() != "aten::sum.dim_IntList" || n.args.size() != 4 || n.outputs.size() != 1) return std::nullopt;
  const auto* self = std::get_if<TensorArg>(&n.args[0]);
  const auto* dims = std::get_if<std::vector<int64_t>>(&n.args[1]);
  const auto* keepdim = std::get_if<bool>(&n.args[2]);
  if (!self || !dims || !keepdim || !std::holds_alternative<graph::NoneArg>(n.args[3])) return std::nullopt;
  const graph::Value& in = g.values[self->id];
  const ScalarType t = in.meta.dtype;
  if (!floating(t) || g.values[n.outputs[0]].meta.dtype != t || in.meta.sizes.empty()) return std::nullopt;
  // x.sum((0, .., m-1)) over x itself (layer norm's weight and bias gradients; with keepdim, RMSNorm's weight
  // gradient as transformers' Llama writes it): two stages or nothing to do.
  const int rank = static_cast<int>(in.meta.sizes.size());
  bool leading_dims = dims->size() >= 2 && static_cast<int>(dims->size()) < rank;
  for (size_t d = 0; d < dims->size() && leading_dims; ++d) leading_dims = (*dims)[d] == static_cast<int64_t>(d);
  if (leading_dims) {
    const int leading = static_cast<int>(dims->size());
    if (!two_stages(in.meta, leading) || (!alongside && !fusable_producer(g, self->id))) return std::nullopt;
    return Plan{self->id, leading, true};
  }
  // x.view(R, C...).sum(0)
  if (*dims != std::vector<int64_t>{0} || in.producer < 0) return std::nullopt;
  const Node& view = g.nodes[in.producer];
  if (!is_flattening_view(view)) return std::nullopt;
  const ValueId base = std::get<TensorArg>(view.args[0]).id;
  const auto& bs = g.values[base].meta.sizes;
  const auto& fs = in.meta.sizes;
  if (g.values[base].meta.dtype != t || bs.size() <= fs.size()) return std::nullopt;
  const int leading = static_cast<int>(bs.size() - fs.size()) + 1;
  int64_t rows = 1;
  for (int d = 0; d < leading; ++d) rows *= bs[d];
  if (rows != fs[0]) return std::nullopt;
  for (size_t d = 1; d < fs.size(); ++d)
    if (bs[leading - 1 + d] != fs[d]) return std::nullopt;
  if (!fusable_producer(g, base)) return std::nullopt;
  return Plan{base, leading};
}

// A second stage waiting for its first reader: sum(partial, [0], keepdim) defining `out`.
struct Pending {
  ValueId partial;
  bool keepdim;
  ValueId out;
  bool view_back = false;  // `out` keeps m leading dims of size 1: the sum over dim 0 is viewed to it
};

}  // namespace

bool stage_row_sums(Graph& g) {
  std::unordered_map<NodeIndex, Plan> plans;
  for (NodeIndex i = 0; i < static_cast<NodeIndex>(g.nodes.size()); ++i)
    if (auto p = plan(g, g.nodes[i])) plans.emplace(i, *p);
  if (plans.empty()) return false;
  // A sum over the same leading dims of a same-shaped value right after a staged one is staged too: its first
  // stage joins that kernel (horizontal fusion), reading its operand once more rather than in a kernel of its own.
  for (NodeIndex i = 1; i < static_cast<NodeIndex>(g.nodes.size()); ++i) {
    if (plans.count(i) || !plans.count(i - 1)) continue;
    const Plan& before = plans.at(i - 1);
    auto p = plan(g, g.nodes[i], /*alongside=*/true);
    if (p && p->leading == before.leading && g.values[p->base].meta.sizes == g.values[before.base].meta.sizes)
      plans.emplace(i, *p);
  }
  GraphRewriter rewriter(g);
  std::vector<Node> nodes = rewriter.take_nodes();
  auto sum = [&](ValueId of, std::vector<int64_t> dims, bool keep, ValueId reuse) {
    graph::TensorMeta m = g.values[of].meta;
    m.requires_grad = false;
    m.storage_offset = 0;
    std::vector<int64_t> sizes;
    for (size_t d = 0; d < m.sizes.size(); ++d) {
      const bool reduced = std::find(dims.begin(), dims.end(), static_cast<int64_t>(d)) != dims.end();
      if (!reduced) sizes.push_back(m.sizes[d]);
      else if (keep) sizes.push_back(1);
    }
    m.sizes = sizes;
    m.strides = graph::contiguous_strides(sizes);
    if (reuse >= 0) m = g.values[reuse].meta;
    return rewriter.add("aten::sum", "dim_IntList", {TensorArg{of}, std::move(dims), keep, graph::NoneArg{}},
                        {"self", "dim", "keepdim", "dtype"}, 3, m, false, reuse);
  };
  // Second stages are emitted just before their first reader (or at the end): first stages of neighbouring sums
  // over the same rows (a layer norm's weight and bias gradients) stay next to each other and share a kernel.
  std::vector<Pending> pending;
  auto flush = [&](const Node* reader) {
    std::vector<Pending> kept;
    for (const Pending& p : pending) {
      bool read = reader == nullptr;
      if (reader)
        for (const graph::ArgValue& arg : reader->args) graph::for_each_tensor(arg, [&](ValueId v) { read = read || v == p.out; });
      if (!read) {
        kept.push_back(p);
      } else if (p.view_back) {
        const graph::TensorMeta& om = g.values[p.out].meta;
        rewriter.add("aten::view", "default", {TensorArg{sum(p.partial, {0}, false, -1)}, om.sizes}, {"self", "size"}, 2,
                     om, true, p.out);
      } else {
        sum(p.partial, {0}, p.keepdim, p.out);
      }
    }
    pending = std::move(kept);
  };
  for (NodeIndex i = 0; i < static_cast<NodeIndex>(nodes.size()); ++i) {
    if (!pending.empty()) flush(&nodes[i]);
    auto it = plans.find(i);
    if (it == plans.end()) {
      rewriter.append(std::move(nodes[i]));
      continue;
    }
    const Node& n = nodes[i];
    const Plan& p = it->second;
    const bool keepdim = std::get<bool>(n.args[2]);
    const ValueId out = n.outputs[0];
    const graph::TensorMeta& base = g.values[p.base].meta;
    std::vector<int64_t> rest;
    for (int d = 1; d < p.leading; ++d) rest.push_back(d);
    if (two_stages(base, p.leading)) {
      pending.push_back({sum(p.base, rest, false, -1), keepdim && !p.direct, out, keepdim && p.direct});
      continue;
    }
    rest.insert(rest.begin(), 0);
    if (!keepdim) {  // [C...]: the one sum defines the node's output itself
      sum(p.base, rest, false, out);
      continue;
    }
    const ValueId whole = sum(p.base, rest, false, -1);
    const graph::TensorMeta& om = g.values[out].meta;
    rewriter.add("aten::view", "default", {TensorArg{whole}, om.sizes}, {"self", "size"}, 2, om, true, out);
  }
  flush(nullptr);
  return true;
}

}  // namespace kiln::passes
