// The op-by-op interpreter behind the "eager" backend.
//
// Design: everything that does not depend on the call's tensors is done once, at compile time: the
// OperatorHandle lookup, the conversion of every non-tensor argument (and constant tensor) into the
// IValue the schema expects, and the liveness plan. A call then copies each node's prepared stack,
// drops the call's tensors into their slots, calls the op at the top of the dispatcher (so autograd,
// autocast and every other key behave exactly as in eager) and frees intermediates after their last use.
#include "runtime/eager_interpreter.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <ATen/ops/scalar_tensor.h>

#include <unordered_set>

#include "common/error.h"
#include "common/log.h"

namespace kiln::runtime {

CompiledGraph::~CompiledGraph() = default;

namespace {

using graph::ValueId;

// A stack position filled per call with one tensor.
struct TensorSlot {
  int32_t position;
  ValueId id;
};

// A stack position filled per call with a Tensor[] / Tensor?[] built from values.
struct TensorListSlot {
  int32_t position;
  bool optional_elements;  // Tensor?[] (c10::List<std::optional<Tensor>>)
  std::vector<std::optional<ValueId>> ids;
};

struct PreparedNode {
  std::optional<c10::OperatorHandle> op;  // always set; optional only because handles have no default
  std::string name;  // "aten::addmm.default", for error messages
  std::vector<c10::IValue> stack_template;
  std::vector<TensorSlot> tensor_slots;
  std::vector<TensorListSlot> list_slots;
  std::vector<ValueId> outputs;
  bool returns_list = false;
  std::vector<ValueId> release_after;  // intermediates whose last use is this node
};

bool is_optional_tensor_list(const c10::TypePtr& type) {
  c10::TypePtr t = type;
  if (auto opt = t->cast<c10::OptionalType>()) t = opt->getElementType();
  auto list = t->cast<c10::ListType>();
  return list && list->getElementType()->kind() == c10::TypeKind::OptionalType;
}

bool expects_tensor(const c10::TypePtr& type) {
  c10::TypePtr t = type;
  if (auto opt = t->cast<c10::OptionalType>()) t = opt->getElementType();
  return t->kind() == c10::TypeKind::TensorType;
}

// `x + 1.0` reaches __torch_dispatch__ as add.Tensor(x, 1.0): the Python number stands for a "wrapped
// number" tensor, which type promotion treats like a scalar. Rebuild exactly that.
c10::IValue wrapped_number(const c10::Scalar& s, at::ScalarType dtype) {
  at::Tensor t = at::scalar_tensor(s, at::TensorOptions().dtype(dtype).device(at::kCPU));
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

bool expects_float(const c10::TypePtr& type) {
  c10::TypePtr t = type;
  if (auto opt = t->cast<c10::OptionalType>()) t = opt->getElementType();
  return t->kind() == c10::TypeKind::FloatType;
}

// Non-tensor ArgValue -> IValue, one overload per alternative (tensor kinds are handled by the caller).
struct ConstantArgToIValue {
  const c10::Argument& schema_arg;
  c10::IValue operator()(const graph::NoneArg&) const { return {}; }
  c10::IValue operator()(const graph::TensorArg&) const { return {}; }
  c10::IValue operator()(const graph::TensorListArg&) const { return {}; }
  c10::IValue operator()(bool b) const {
    if (expects_tensor(schema_arg.type())) return wrapped_number(b, at::kBool);
    return b;
  }
  c10::IValue operator()(int64_t i) const {
    if (expects_tensor(schema_arg.type())) return wrapped_number(i, at::kLong);
    // Python hands integral defaults to float parameters ("float eps=1"): the schema decides.
    if (expects_float(schema_arg.type())) return static_cast<double>(i);
    return i;
  }
  c10::IValue operator()(double d) const {
    if (expects_tensor(schema_arg.type())) return wrapped_number(d, at::kDouble);
    return d;
  }
  c10::IValue operator()(const std::complex<double>& c) const {
    const c10::complex<double> value(c.real(), c.imag());
    if (expects_tensor(schema_arg.type())) return wrapped_number(value, at::kComplexDouble);
    return value;
  }
  c10::IValue operator()(const std::string& s) const { return s; }
  c10::IValue operator()(const std::vector<int64_t>& v) const { return v; }
  c10::IValue operator()(const std::vector<double>& v) const { return v; }
  c10::IValue operator()(const std::vector<bool>& v) const {
    c10::List<bool> list;
    for (bool b : v) list.push_back(b);
    return list;
  }
  c10::IValue operator()(const graph::ScalarTypeArg& t) const { return static_cast<int64_t>(t.type); }
  c10::IValue operator()(const graph::LayoutArg& l) const { return static_cast<int64_t>(l.code); }
  c10::IValue operator()(const graph::MemoryFormatArg& m) const { return static_cast<int64_t>(m.code); }
  c10::IValue operator()(const graph::Device& d) const {
    return c10::Device(static_cast<c10::DeviceType>(d.type), d.index);
  }
};

class EagerInterpreter final : public CompiledGraph {
 public:
  EagerInterpreter(std::shared_ptr<const graph::Graph> g, std::vector<at::Tensor> constants)
      : graph_(std::move(g)), constants_(std::move(constants)) {
    constants_.resize(graph_->values.size());
    prepare_nodes();
    plan_releases();
  }

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) override {
    const graph::Graph& g = *graph_;
    KILN_CHECK(inputs.size() == g.inputs.size())
        << "compiled graph expects " << g.inputs.size() << " input tensors, got " << inputs.size();
    std::vector<at::Tensor> env(g.values.size());
    for (size_t i = 0; i < inputs.size(); ++i) env[g.inputs[i]] = inputs[i];

    torch::jit::Stack stack;
    for (const PreparedNode& node : nodes_) {
      stack = node.stack_template;
      for (const TensorSlot& slot : node.tensor_slots) stack[slot.position] = env[slot.id];
      for (const TensorListSlot& slot : node.list_slots) stack[slot.position] = build_list(slot, env);
      node.op->callBoxed(stack);
      store_outputs(node, stack, env);
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

  c10::IValue build_list(const TensorListSlot& slot, const std::vector<at::Tensor>& env) const {
    if (slot.optional_elements) {
      c10::List<std::optional<at::Tensor>> list;
      list.reserve(slot.ids.size());
      for (const auto& id : slot.ids)
        list.push_back(id ? std::optional<at::Tensor>(lookup(*id, env)) : std::nullopt);
      return list;
    }
    c10::List<at::Tensor> list;
    list.reserve(slot.ids.size());
    for (const auto& id : slot.ids) list.push_back(lookup(*id, env));
    return list;
  }

  static void store_outputs(const PreparedNode& node, torch::jit::Stack& stack, std::vector<at::Tensor>& env) {
    if (node.returns_list) {
      KILN_ASSERT_EQ(stack.size(), 1u) << "list-returning op " << node.name;
      std::vector<at::Tensor> items = stack[0].toTensorVector();
      KILN_ASSERT_EQ(items.size(), node.outputs.size())
          << node.name << " returned a different number of tensors than when it was captured";
      for (size_t i = 0; i < items.size(); ++i) env[node.outputs[i]] = std::move(items[i]);
      return;
    }
    KILN_ASSERT_EQ(stack.size(), node.outputs.size()) << "returns of " << node.name;
    for (size_t i = 0; i < stack.size(); ++i) env[node.outputs[i]] = std::move(stack[i]).toTensor();
  }

  void prepare_nodes() {
    const graph::Graph& g = *graph_;
    nodes_.reserve(g.nodes.size());
    for (const graph::Node& node : g.nodes) {
      PreparedNode prepared;
      prepared.name = node.qualified_name();
      const std::string overload = node.overload == "default" ? "" : node.overload;
      auto handle = c10::Dispatcher::singleton().findSchema({node.op, overload});
      KILN_CHECK(handle.has_value()) << "eager backend: no ATen operator " << prepared.name
                                     << " is registered with the dispatcher";
      prepared.op = *handle;
      const auto& schema_args = prepared.op->schema().arguments();
      KILN_ASSERT_EQ(schema_args.size(), node.args.size()) << "argument count of " << prepared.name;
      for (size_t i = 0; i < node.args.size(); ++i) {
        const auto position = static_cast<int32_t>(i);
        const graph::ArgValue& arg = node.args[i];
        if (auto* t = std::get_if<graph::TensorArg>(&arg)) {
          if (g.values[t->id].is_constant) {
            prepared.stack_template.emplace_back(constants_[t->id]);
          } else {
            prepared.tensor_slots.push_back({position, t->id});
            prepared.stack_template.emplace_back();
          }
        } else if (auto* list = std::get_if<graph::TensorListArg>(&arg)) {
          prepared.list_slots.push_back({position, is_optional_tensor_list(schema_args[i].type()), list->ids});
          prepared.stack_template.emplace_back();
        } else {
          prepared.stack_template.push_back(std::visit(ConstantArgToIValue{schema_args[i]}, arg));
        }
      }
      prepared.outputs = node.outputs;
      prepared.returns_list = node.returns_list;
      nodes_.push_back(std::move(prepared));
    }
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
  std::vector<PreparedNode> nodes_;
};

}  // namespace

std::shared_ptr<CompiledGraph> make_eager_interpreter(std::shared_ptr<const graph::Graph> g,
                                                      std::vector<at::Tensor> constants) {
  KILN_LOG(graph) << "eager backend: " << g->nodes.size() << " nodes\n" << g->to_string();
  return std::make_shared<EagerInterpreter>(std::move(g), std::move(constants));
}

}  // namespace kiln::runtime
