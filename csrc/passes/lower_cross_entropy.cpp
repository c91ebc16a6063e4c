// Cross entropy as logsumexp minus a gather (passes/lower_cross_entropy.h).
//
// Design: a plan per nll_loss_forward node found on the graph before any change, then one rebuild of the node list
// (GraphRewriter) in which each planned node is replaced by the ops of the header's formula. The per-row values keep
// x's [N, 1] shape until the end (target[:, None], not a view of an intermediate), so that every one of them is a
// value of the row reduction's kernel rather than a tensor a view has to read. Metas come from the OpOracle; which
// values need grad follows x.
#include "passes/lower_cross_entropy.h"

#include <algorithm>
#include <optional>

#include "common/error.h"
#include "passes/graph_rewriter.h"
#include "passes/remove_dead_nodes.h"

namespace kiln::passes {

using graph::ArgValue;
using graph::Graph;
using graph::Node;
using graph::ScalarType;
using graph::TensorArg;
using graph::TensorMeta;
using graph::ValueId;

namespace {

enum Reduction : int64_t { kNone = 0, kMean = 1, kSum = 2 };  // at::Reduction

struct CrossEntropy {
  ValueId logits, target;
  int64_t reduction, ignore_index;
  bool batched;  // x is [N, C] (else [C], the target 0-d)
};

// An int argument (a dim, the reduction, the ignore index).
std::optional<int64_t> int_at(const Node& n, size_t i) {
  if (const auto* v = i < n.args.size() ? std::get_if<int64_t>(&n.args[i]) : nullptr) return *v;
  return std::nullopt;
}

// Per value: read by a node the dead-node sweep would keep, or returned (remove_dead_nodes' liveness, without
// removing anything). The recorder's detach of the log_softmax (autograd's saved output) is such a dead reader.
std::vector<bool> live_values(const Graph& g) {
  std::vector<bool> live(g.values.size(), false);
  for (ValueId out : g.outputs) live[out] = true;
  for (size_t i = g.nodes.size(); i-- > 0;) {
    const Node& node = g.nodes[i];
    bool needed = !is_pure_node(g, node);
    for (ValueId out : node.outputs) needed = needed || live[out];
    if (needed)
      for (const ArgValue& arg : node.args) graph::for_each_tensor(arg, [&](ValueId id) { live[id] = true; });
  }
  return live;
}

// The log_softmax over the last dim of a float32/float64 1-d or 2-d tensor that `v` is, or nullopt.
std::optional<ValueId> log_softmax_input(const Graph& g, ValueId v) {
  const graph::Value& value = g.value(v);
  if (value.producer < 0) return std::nullopt;
  const Node& n = g.nodes[value.producer];
  const std::string name = n.qualified_name();
  if (name == "aten::_log_softmax.default") {
    const bool* half_to_float = n.args.size() > 2 ? std::get_if<bool>(&n.args[2]) : nullptr;
    if (!half_to_float || *half_to_float) return std::nullopt;
  } else if (name == "aten::log_softmax.int") {
    if (n.args.size() < 3 || !std::holds_alternative<graph::NoneArg>(n.args[2])) return std::nullopt;
  } else {
    return std::nullopt;
  }
  const std::optional<ValueId> x = tensor_at(n, 0);
  const std::optional<int64_t> dim = int_at(n, 1);
  if (!x || !dim) return std::nullopt;
  const TensorMeta& m = g.value(*x).meta;
  const auto rank = static_cast<int64_t>(m.sizes.size());
  if ((rank != 1 && rank != 2) || (*dim != rank - 1 && *dim != -1)) return std::nullopt;
  if (m.dtype != ScalarType::Float && m.dtype != ScalarType::Double) return std::nullopt;
  return x;
}

std::optional<CrossEntropy> cross_entropy(const Graph& g, const Node& n, const std::vector<int>& live_readers) {
  if (n.qualified_name() != "aten::nll_loss_forward.default" || n.args.size() != 5 || n.outputs.size() != 2)
    return std::nullopt;
  const std::optional<ValueId> input = tensor_at(n, 0), target = tensor_at(n, 1);
  const std::optional<int64_t> reduction = int_at(n, 3), ignore_index = int_at(n, 4);
  if (!input || !target || !reduction || !ignore_index || !std::holds_alternative<graph::NoneArg>(n.args[2]))
    return std::nullopt;
  if (*reduction != kNone && *reduction != kMean && *reduction != kSum) return std::nullopt;
  // The log_softmax's one live reader is this loss, which stops reading it.
  if (live_readers[*input] != 1 || std::find(g.outputs.begin(), g.outputs.end(), *input) != g.outputs.end())
    return std::nullopt;
  const std::optional<ValueId> x = log_softmax_input(g, *input);
  if (!x) return std::nullopt;
  const TensorMeta& xm = g.value(*x).meta;
  const TensorMeta& tm = g.value(*target).meta;
  const bool batched = xm.sizes.size() == 2;
  const int64_t rows = batched ? xm.sizes[0] : 1;
  if (tm.dtype != ScalarType::Long || !(tm.device == xm.device) || tm.sizes.size() != (batched ? 1u : 0u) ||
      (batched && tm.sizes[0] != rows) || rows == 0 || xm.sizes.back() == 0)
    return std::nullopt;
  // reduction='none' over rows gives total_weight 0 (a fill this lowering does not make): kept where it is read.
  if (batched && *reduction == kNone && graph::is_read(g, n.outputs[1])) return std::nullopt;
  return CrossEntropy{*x, *target, *reduction, *ignore_index, batched};
}

class Lowering {
 public:
  Lowering(Graph& g, graph::OpOracle& oracle) : rewriter_(g), oracle_(oracle) {}

  bool run(const std::vector<std::optional<CrossEntropy>>& plan) {
    return rewriter_.replace_planned(plan, [&](const CrossEntropy& ce, const Node& node) {
      lower(ce, node.outputs[0], node.outputs[1]);
    });
  }

 private:
  Graph& g() { return rewriter_.graph(); }

  // The op through the oracle (GraphRewriter::add_completed); its result needs grad when `from_x` and x does.
  ValueId emit(const char* op, const char* overload, std::vector<ArgValue> args, bool from_x, ValueId reuse = -1) {
    return rewriter_.add_completed(oracle_, op, overload, std::move(args), from_x && requires_grad_, reuse);
  }

  void lower(const CrossEntropy& ce, ValueId output, ValueId total_weight) {
    requires_grad_ = g().value(ce.logits).meta.requires_grad;
    const ScalarType dtype = g().value(ce.logits).meta.dtype;
    auto t = [](ValueId v) { return ArgValue{TensorArg{v}}; };
    const ValueId x = ce.batched ? ce.logits : emit("aten::unsqueeze", "default", {t(ce.logits), int64_t{0}}, true);
    ValueId target = ce.batched ? ce.target : emit("aten::unsqueeze", "default", {t(ce.target), int64_t{0}}, false);
    target = emit("aten::unsqueeze", "default", {t(target), int64_t{1}}, false);  // [N, 1]
    // The row reduction first: the per-row ops after it join its kernel (fusion/schedule_kernels.cpp).
    const ValueId lse = emit("aten::logsumexp", "default", {t(x), std::vector<int64_t>{1}, true}, true);
    const ValueId ignored = emit("aten::eq", "Scalar", {t(target), ce.ignore_index}, false);
    const ValueId safe = emit("aten::masked_fill", "Scalar", {t(target), t(ignored), int64_t{0}}, false);
    const ValueId picked = emit("aten::gather", "default", {t(x), int64_t{1}, t(safe), false}, true);
    const ValueId nll = emit("aten::sub", "Tensor", {t(lse), t(picked), int64_t{1}}, true);
    const ValueId losses = emit("aten::masked_fill", "Scalar", {t(nll), t(ignored), 0.0}, true);
    // total_weight: the targets not ignored (a 1-d input's too under reduction='none'; a 2-d one's is only read
    // where the plan let it through, which it does not under 'none').
    if (ce.reduction != kNone || !ce.batched) {
      const ValueId counted = emit("aten::ne", "Scalar", {t(target), ce.ignore_index}, false);
      emit("aten::sum", "default", {t(counted), graph::ScalarTypeArg{dtype}}, false, total_weight);
    }
    if (ce.reduction == kSum) {
      emit("aten::sum", "default", {t(losses), graph::NoneArg{}}, true, output);
    } else if (ce.reduction == kMean) {
      const ValueId total = emit("aten::sum", "default", {t(losses), graph::NoneArg{}}, true);
      emit("aten::div", "Tensor", {t(total), t(total_weight)}, true, output);
    } else if (ce.batched) {
      emit("aten::squeeze", "dim", {t(losses), int64_t{1}}, true, output);
    } else {
      emit("aten::view", "default", {t(losses), std::vector<int64_t>{}}, true, output);
    }
  }

  GraphRewriter rewriter_;
  graph::OpOracle& oracle_;
  bool requires_grad_ = false;  // x's
};

}  // namespace

bool has_cross_entropy(const Graph& g) {
  for (const Node& node : g.nodes)
    if (node.qualified_name() == "aten::nll_loss_forward.default") return true;
  return false;
}

bool lower_cross_entropy(Graph& g, graph::OpOracle& oracle) {
  if (!has_cross_entropy(g)) return false;
  const std::vector<bool> live = live_values(g);
  std::vector<int> live_readers(g.values.size(), 0);
  for (const Node& node : g.nodes) {
    bool node_live = !is_pure_node(g, node);
    for (ValueId out : node.outputs) node_live = node_live || live[out];
    if (!node_live) continue;
    for (const ArgValue& arg : node.args) graph::for_each_tensor(arg, [&](ValueId id) { live_readers[id]++; });
  }
  std::vector<std::optional<CrossEntropy>> plan;
  bool any = false;
  for (const Node& node : g.nodes) {
    plan.push_back(cross_entropy(g, node, live_readers));
    any = any || plan.back().has_value();
  }
  return any && Lowering(g, oracle).run(plan);
}

}  // namespace kiln::passes
