// The op-by-op interpreter behind the "eager" backend.
//
// Design: everything that does not depend on the call's tensors is done once, at compile time: the
// OperatorHandle lookup, the conversion of every non-tensor argument (and constant tensor) into the
// IValue the schema expects, and the liveness plan. A call then copies each node's prepared stack,
// drops the call's tensors into their slots, calls the op at the top of the dispatcher (so autograd,
// autocast and every other key behave exactly as in eager) and frees intermediates after their last use.
#include "runtime/eager_interpreter.h"

#include <unordered_set>

#include "common/error.h"
#include "common/log.h"
#include "runtime/node_call.h"

namespace kiln::runtime {

CompiledGraph::~CompiledGraph() = default;

namespace {

using graph::ValueId;

struct InterpretedNode {
  PreparedNode call;
  std::vector<ValueId> release_after;  // intermediates whose last use is this node
};

class EagerInterpreter final : public CompiledGraph {
 public:
  EagerInterpreter(std::shared_ptr<const graph::Graph> g, std::vector<at::Tensor> constants)
      : graph_(std::move(g)), constants_(std::move(constants)), custom_ops_(calls_custom_ops(*graph_)) {
    constants_.resize(graph_->values.size());
    prepare_nodes();
    plan_releases();
  }

  bool reenters_python() const override { return custom_ops_; }

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) override {
    const graph::Graph& g = *graph_;
    KILN_CHECK(inputs.size() == g.inputs.size())
        << "compiled graph expects " << g.inputs.size() << " input tensors, got " << inputs.size();
    std::vector<at::Tensor> env(g.values.size());
    for (size_t i = 0; i < inputs.size(); ++i) env[g.inputs[i]] = inputs[i];

    for (const InterpretedNode& node : nodes_) {
      call_node(node.call, g, constants_, env);
      for (ValueId id : node.release_after) env[id].reset();
    }

    std::vector<at::Tensor> outputs;
    outputs.reserve(g.outputs.size());
    for (ValueId id : g.outputs) outputs.push_back(lookup(id, env));
    return outputs;
  }

 private:
  const at::Tensor& lookup(ValueId id, const std::vector<at::Tensor>& env) const {
    return graph_->values[id].is_constant ? constants_[id] : env[id];
  }

  void prepare_nodes() {
    const graph::Graph& g = *graph_;
    nodes_.reserve(g.nodes.size());
    for (const graph::Node& node : g.nodes) nodes_.push_back({prepare_node(g, node, constants_), {}});
  }

  // An intermediate is freed right after the last node that reads it (or right after its producer when
  // nothing reads it). Graph outputs, inputs and constants are never freed here.
  void plan_releases() {
    const graph::Graph& g = *graph_;
    std::vector<int32_t> last_use(g.values.size(), -1);
    for (size_t n = 0; n < g.nodes.size(); ++n) {
      for (const graph::ArgValue& arg : g.nodes[n].args)
        graph::for_each_tensor(arg, [&](ValueId id) { last_use[id] = static_cast<int32_t>(n); });
      for (ValueId out : g.nodes[n].outputs)
        if (last_use[out] < static_cast<int32_t>(n)) last_use[out] = static_cast<int32_t>(n);
    }
    std::unordered_set<ValueId> kept(g.outputs.begin(), g.outputs.end());
    for (const graph::Value& v : g.values) {
      if (v.producer < 0 || kept.count(v.id) || last_use[v.id] < 0) continue;
      nodes_[last_use[v.id]].release_after.push_back(v.id);
    }
  }

  std::shared_ptr<const graph::Graph> graph_;
  std::vector<at::Tensor> constants_;  // indexed by ValueId; defined for constants only
  bool custom_ops_;
  std::vector<InterpretedNode> nodes_;
};

}  // namespace

namespace {
// Whether in-place or out= `node` writes a tensor autograd tracks (a parameter updated under no_grad). One that writes
// a buffer or a no_grad result (an EMA of activations kept in a buffer: `avg.lerp_(y.mean(0), 0.1)`) changes
// nothing autograd sees, and the graph's halves run with grad off anyway.
bool writes_a_tensor_that_requires_grad(const graph::Graph& g, const graph::Node& node) {
  for (size_t i = 0; i < node.args.size(); ++i) {
    const auto* t = std::get_if<graph::TensorArg>(&node.args[i]);
    const bool written = node.op.back() == '_' ? i == 0 : i < node.arg_names.size() && node.arg_names[i] == "out";
    if (t && written && g.value(t->id).meta.requires_grad) return true;
  }
  for (graph::ValueId out : node.outputs)
    if (g.value(out).meta.requires_grad) return true;
  return false;
}
}  // namespace

bool needs_eager_for_grad_mode(const graph::Graph& g) {
  bool switches = false, requires_grad = false;
  for (const graph::Node& node : g.nodes) switches = switches || node.op == "kiln::set_grad_enabled";
  for (const graph::Value& v : g.values) requires_grad = requires_grad || v.meta.requires_grad;
  if (!switches || !requires_grad) return false;
  // The graph is entered with grad enabled (it needs autograd). Each switch must flip the mode, the graph must end
  // enabled, and no node may write a tensor that requires grad while grad is off: a `with torch.no_grad():` block, or
  // several, as in a rotary embedding's @torch.no_grad() forward. Anything else (a switch that restores a mode the graph did not enter
  // with, a graph that ends inside a block, an in-place update under no_grad of a tensor that requires grad) is left to the interpreter.
  bool enabled = true;
  for (const graph::Node& node : g.nodes) {
    if (node.op == "kiln::set_grad_enabled") {
      const bool* to = node.args.empty() ? nullptr : std::get_if<bool>(&node.args[0]);
      if (!to || *to == enabled) return true;
      enabled = *to;
    } else if (!enabled && node.mutates_args && writes_a_tensor_that_requires_grad(g, node)) {
      return true;
    }
  }
  return !enabled;
}

bool calls_custom_ops(const graph::Graph& g) {
  for (const graph::Node& node : g.nodes) {
    const std::string ns = node.op.substr(0, node.op.find("::"));
    if (ns != "aten" && ns != "prims" && ns != "kiln") return true;
  }
  return false;
}

std::shared_ptr<CompiledGraph> make_eager_interpreter(std::shared_ptr<const graph::Graph> g,
                                                      std::vector<at::Tensor> constants) {
  KILN_LOG(graph) << "eager backend: " << g->nodes.size() << " nodes\n" << g->to_string();
  return std::make_shared<EagerInterpreter>(std::move(g), std::move(constants));
}

}  // namespace kiln::runtime
