// The autograd partition as a minimum cut (partition.h).
//
// Design: the joint walk leaves a backward graph that reads, as saved tensors, every forward value a
// derivative rule asked for. Many of those are cheap functions of values the forward keeps anyway: gelu's
// output is gelu(its saved input), q * scale is one multiply of a saved projection. "What should the
// forward save so that the backward can rebuild everything it reads, in the fewest bytes" is a minimum
// cut over the forward graph (the idea of the rematerialising partitioners of NNC and AOTAutograd):
//
//   - each forward value v is two flow nodes in(v) -> out(v) whose capacity is what saving v costs:
//     0 for graph inputs and for the outputs the caller receives (alive anyway), infinite for views
//     (saving one keeps its base alive, and the backward redoes them for free), else numel * item size;
//   - the source feeds in(v) of every value the backward must not recompute: graph inputs, constants,
//     results of ops that are not cheap (matmul, convolution, reductions, normalisations, extern ops),
//     random ops (the backward would draw different numbers), in-place ops, and results past the chain
//     bound below;
//   - out(a) -> in(v) for each tensor argument a of a recomputable node defining v (infinite);
//   - out(v) -> sink for each value a derivative rule reads (infinite).
// A finite cut crosses only split edges: those values are saved, and everything the backward reads on
// the sink side of the cut is recomputed from them. Among minimum cuts we take the one nearest the sink,
// so a tie never adds recomputation (saving b = a + bias costs what saving a does: keep b).
#include "autodiff/partition.h"

#include <algorithm>
#include <map>
#include <optional>

#include "autodiff/backward_builder.h"
#include "autodiff/max_flow.h"
#include "common/error.h"
#include "graph/op_facts.h"

namespace kiln::autodiff {

namespace {

using graph::Graph;
using graph::Node;
using graph::ScalarType;
using graph::Value;
using graph::ValueId;

// A recomputed value is at most this many pointwise ops away from a saved value or a graph input. The
// backward's fusion folds such a chain into the kernel that reads it, so redoing it costs arithmetic on
// data that kernel loads anyway. Eight covers the longest chains real models write op by op (GELU's tanh
// approximation spelled out is seven) but stops the backward from redoing a layer's worth of elementwise
// math: a node past the bound is treated as not recomputable, and the next chain starts at it.
constexpr int kMaxRecomputeDepth = 8;

// How the backward may obtain a node's result.
enum class Recompute : uint8_t {
  kNever,      // saved (or, for an input or constant, read as it is)
  kView,       // redone from its base for free
  kPointwise,  // redone from its operands, within kMaxRecomputeDepth
};

template <typename Fn>
void for_each_tensor_arg(const Node& node, Fn&& fn) {
  for (const graph::ArgValue& arg : node.args) graph::for_each_tensor(arg, fn);
}

bool operands_on_output_device(const Graph& g, const Node& node) {
  const graph::Device device = g.value(node.outputs.front()).meta.device;
  bool same = true;
  for_each_tensor_arg(node, [&](ValueId id) { same = same && g.value(id).meta.device == device; });
  return same;
}

// Per node of `g`, how the backward may obtain its result.
std::vector<Recompute> classify_nodes(const Graph& g) {
  // Storage each value aliases (through view nodes), and the storages some in-place op may write: a
  // value computed from them must be read before the write, so the backward may not redo it.
  std::vector<ValueId> root(g.values.size());
  for (size_t v = 0; v < root.size(); ++v) root[v] = static_cast<ValueId>(v);
  std::vector<bool> written(g.values.size(), false);
  for (const Node& node : g.nodes) {
    std::optional<ValueId> base;
    for_each_tensor_arg(node, [&](ValueId id) {
      if (!base) base = root[id];
      if (node.mutates_args) written[root[id]] = true;
    });
    if (node.is_view && base)
      for (ValueId out : node.outputs) root[out] = *base;
  }

  std::vector<Recompute> kinds(g.nodes.size(), Recompute::kNever);
  std::vector<int> depth(g.values.size(), 0);  // pointwise ops since the nearest non-recomputable value
  for (size_t n = 0; n < g.nodes.size(); ++n) {
    const Node& node = g.nodes[n];
    const graph::OpFacts& facts = graph::op_facts(node.qualified_name());
    Recompute kind = Recompute::kNever;
    const bool single_result = node.outputs.size() == 1 && !node.returns_list && !node.mutates_args;
    // Random ops are checked first: the backward would draw different numbers than the forward did, whatever
    // their cost class says.
    if (single_result && !facts.random) {
      if (facts.cost == graph::OpCost::kView) {
        kind = Recompute::kView;
      } else if (facts.cost == graph::OpCost::kPointwise && operands_on_output_device(g, node)) {
        bool reads_written = false;
        for_each_tensor_arg(node, [&](ValueId id) { reads_written = reads_written || written[root[id]]; });
        if (!reads_written) kind = Recompute::kPointwise;
      }
    }
    int chain = 0;
    for_each_tensor_arg(node, [&](ValueId id) { chain = std::max(chain, depth[id]); });
    if (kind == Recompute::kPointwise && ++chain > kMaxRecomputeDepth) kind = Recompute::kNever;
    if (kind == Recompute::kNever) chain = 0;
    for (ValueId out : node.outputs) depth[out] = chain;
    kinds[n] = kind;
  }
  return kinds;
}

// Rebuilds the backward graph with the partition's inputs, inserting each recomputation right before
// the first backward node that reads it (so recomputed values live no longer than the backward needs).
class BackwardRebuilder {
 public:
  BackwardRebuilder(const Graph& forward, const std::vector<Recompute>& kinds, const Graph& old_backward)
      : forward_(forward), kinds_(kinds), old_(old_backward), new_of_old_(old_backward.values.size(), -1),
        forward_of_placeholder_(old_backward.values.size(), -1) {}

  Graph rebuild(const std::vector<ValueId>& read, size_t num_gradients, const std::vector<ValueId>& saved) {
    KILN_ASSERT_EQ(old_.inputs.size(), num_gradients + read.size()) << "backward inputs";
    for (size_t i = 0; i < num_gradients; ++i)
      new_of_old_[old_.inputs[i]] = graph_.add_input(old_.value(old_.inputs[i]).meta);
    for (size_t i = 0; i < read.size(); ++i) forward_of_placeholder_[old_.inputs[num_gradients + i]] = read[i];
    for (ValueId f : saved) {
      graph::TensorMeta meta = forward_.value(f).meta;
      meta.requires_grad = false;
      new_of_forward_[f] = graph_.add_input(std::move(meta));
    }
    for (const Node& old_node : old_.nodes) {
      Node node = old_node;
      remap_args(node, [&](ValueId id) { return new_value(id); });
      std::vector<graph::TensorMeta> metas;
      for (ValueId out : old_node.outputs) metas.push_back(old_.value(out).meta);
      std::vector<ValueId> outs = graph_.add_node(std::move(node), std::move(metas));
      for (size_t i = 0; i < outs.size(); ++i) new_of_old_[old_node.outputs[i]] = outs[i];
    }
    std::vector<ValueId> outputs;
    for (ValueId id : old_.outputs) outputs.push_back(new_value(id));
    graph_.set_outputs(std::move(outputs));
    return std::move(graph_);
  }

  int64_t recomputed_nodes() const { return recomputed_nodes_; }

 private:
  template <typename Fn>
  static void remap_args(Node& node, Fn&& fn) {
    for (graph::ArgValue& arg : node.args) graph::remap_tensors(arg, fn);
  }

  // The new value for old backward value `id`: defined earlier, a constant, or a saved placeholder.
  ValueId new_value(ValueId id) {
    if (new_of_old_[id] >= 0) return new_of_old_[id];
    const Value& v = old_.value(id);
    if (forward_of_placeholder_[id] >= 0) {
      new_of_old_[id] = forward_value(forward_of_placeholder_[id]);
    } else {
      KILN_ASSERT(v.is_constant) << "backward value %" << id << " is read before its definition";
      new_of_old_[id] = copy_constant(v, graph_);
    }
    return new_of_old_[id];
  }

  // Forward value `f` in the new backward: a saved input, a constant, or its producer redone.
  ValueId forward_value(ValueId f) {
    auto found = new_of_forward_.find(f);
    if (found != new_of_forward_.end()) return found->second;
    const Value& v = forward_.value(f);
    ValueId result = -1;
    if (v.is_constant) {
      result = copy_constant(v, graph_);
    } else {
      KILN_ASSERT(v.producer >= 0 && kinds_[v.producer] != Recompute::kNever)
          << "forward value %" << f << " is neither saved nor recomputable (the cut is inconsistent)";
      Node node = forward_.nodes[v.producer];
      remap_args(node, [&](ValueId id) { return forward_value(id); });
      graph::TensorMeta meta = v.meta;
      meta.requires_grad = false;
      result = graph_.add_node(std::move(node), {std::move(meta)}).front();
      recomputed_nodes_++;
    }
    new_of_forward_[f] = result;
    return result;
  }

  const Graph& forward_;
  const std::vector<Recompute>& kinds_;
  const Graph& old_;
  Graph graph_;
  std::vector<ValueId> new_of_old_;              // by old backward ValueId
  std::vector<ValueId> forward_of_placeholder_;  // by old backward ValueId: the forward value it stood for
  std::map<ValueId, ValueId> new_of_forward_;
  int64_t recomputed_nodes_ = 0;
};

}  // namespace

Partition partition_saved_values(const Graph& forward, const std::vector<ValueId>& read, size_t num_gradients,
                                 Graph& backward) {
  const std::vector<Recompute> kinds = classify_nodes(forward);
  const auto num_values = static_cast<int>(forward.values.size());
  auto in = [](ValueId v) { return 2 * v; };
  auto out = [](ValueId v) { return 2 * v + 1; };
  const int source = 2 * num_values, sink = 2 * num_values + 1;

  std::vector<bool> returned(forward.values.size(), false);  // the caller receives it: saving is free
  for (ValueId id : forward.outputs) returned[id] = true;
  auto free_to_save = [&](const Value& v) { return v.is_input || v.is_constant || returned[v.id]; };

  MaxFlow flow(2 * num_values + 2);
  for (const Value& v : forward.values) {
    const Recompute kind = v.producer >= 0 ? kinds[v.producer] : Recompute::kNever;
    int64_t cost = graph::nbytes(v.meta);
    if (free_to_save(v)) cost = 0;
    else if (kind == Recompute::kView) cost = MaxFlow::kInfinite;
    flow.add_edge(in(v.id), out(v.id), cost);
    if (kind == Recompute::kNever) {
      flow.add_edge(source, in(v.id), MaxFlow::kInfinite);
    } else {
      for_each_tensor_arg(forward.nodes[v.producer], [&](ValueId arg) { flow.add_edge(out(arg), in(v.id), MaxFlow::kInfinite); });
    }
  }
  for (ValueId id : read) flow.add_edge(out(id), sink, MaxFlow::kInfinite);
  KILN_ASSERT(flow.run(source, sink) < MaxFlow::kInfinite) << "no finite cut between forward and backward";

  Partition partition;
  const std::vector<bool> sink_side = flow.reaches_sink(sink);
  for (const Value& v : forward.values) {
    if (v.is_constant || sink_side[in(v.id)] || !sink_side[out(v.id)]) continue;
    partition.saved.push_back(v.id);  // in(v) before the cut, out(v) after it: v's split edge is cut
    if (free_to_save(v)) continue;
    partition.saved_tensors++;
    partition.saved_bytes += graph::nbytes(v.meta);
  }
  for (ValueId id : read)
    if (!free_to_save(forward.value(id))) partition.saved_bytes_before += graph::nbytes(forward.value(id).meta);

  BackwardRebuilder rebuilder(forward, kinds, backward);
  backward = rebuilder.rebuild(read, num_gradients, partition.saved);
  partition.recomputed_nodes = rebuilder.recomputed_nodes();
  return partition;
}

}  // namespace kiln::autodiff
