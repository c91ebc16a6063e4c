// Preparing and calling one node through the dispatcher (see node_call.h).
#include "runtime/node_call.h"

#include <ATen/core/stack.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/scalar_tensor.h>

#include <algorithm>
#include <unordered_map>

#include "common/error.h"
#include "graph/op_facts.h"

namespace kiln::runtime {

namespace {

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
  c10::IValue operator()(const graph::NoneArg&) const {
    // A non-optional Tensor parameter that ATen's own backward formulas pass undefined (the attention
    // backwards' attn_bias): an undefined tensor, not None.
    if (schema_arg.type()->kind() == c10::TypeKind::TensorType) return at::Tensor();
    return {};
  }
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
    return to_c10(d);
  }
};

const at::Tensor& lookup(graph::ValueId id, const graph::Graph& g, const std::vector<at::Tensor>& constants,
                         const std::vector<at::Tensor>& env) {
  return g.values[id].is_constant ? constants[id] : env[id];
}

c10::IValue build_list(const PreparedNode::TensorListSlot& slot, const graph::Graph& g,
                       const std::vector<at::Tensor>& constants, const std::vector<at::Tensor>& env) {
  if (slot.optional_elements) {
    c10::List<std::optional<at::Tensor>> list;
    list.reserve(slot.ids.size());
    for (const auto& id : slot.ids)
      list.push_back(id ? std::optional<at::Tensor>(lookup(*id, g, constants, env)) : std::nullopt);
    return list;
  }
  c10::List<at::Tensor> list;
  list.reserve(slot.ids.size());
  for (const auto& id : slot.ids) list.push_back(lookup(*id, g, constants, env));
  return list;
}

// True when `t` is laid out as `meta` says, ignoring the strides of size-1 dims (never multiplied by a
// non-zero index).
bool same_layout(const at::Tensor& t, const graph::TensorMeta& meta) {
  if (t.dim() != static_cast<int64_t>(meta.sizes.size())) return false;
  for (int64_t d = 0; d < t.dim(); ++d)
    if (t.size(d) != meta.sizes[d] || (t.size(d) > 1 && t.stride(d) != meta.strides[d])) return false;
  return true;
}

// kiln's own ops: nodes the tracer records for state changes that are not ATen ops. They run directly,
// not through the dispatcher: they switch thread-local state (a dispatcher call would also reach any
// TorchDispatchMode the user has active, as an op it has never heard of). A prepared kiln op has no
// OperatorHandle; its constant arguments sit in stack_template.
using KilnOp = void (*)(const std::vector<c10::IValue>& args);

const std::unordered_map<std::string, KilnOp>& kiln_ops() {
  static const std::unordered_map<std::string, KilnOp> table = {
      // Grad-mode blocks (csrc/trace/grad_mode.cpp): the ops after it run under this mode, as in eager.
      {"kiln::set_grad_enabled.default", [](const std::vector<c10::IValue>& args) { at::GradMode::set_enabled(args.at(0).toBool()); }},
  };
  return table;
}

struct KilnArgToIValue {
  const std::string& name;
  c10::IValue operator()(bool b) const { return b; }
  c10::IValue operator()(int64_t i) const { return i; }
  template <typename Other>
  c10::IValue operator()(const Other&) const {
    KILN_ASSERT(false) << name << ": kiln ops take bool and int arguments only";
    return {};
  }
};

}  // namespace

PreparedNode prepare_node(const graph::Graph& g, const graph::Node& node, const std::vector<at::Tensor>& constants) {
  PreparedNode prepared;
  prepared.name = node.qualified_name();
  if (kiln_ops().count(prepared.name)) {
    for (const graph::ArgValue& arg : node.args) prepared.stack_template.push_back(std::visit(KilnArgToIValue{prepared.name}, arg));
    KILN_ASSERT(node.outputs.empty()) << prepared.name << " defines no values";
    return prepared;
  }
  const std::string overload = node.overload == "default" ? "" : node.overload;
  auto handle = c10::Dispatcher::singleton().findSchema({node.op, overload});
  KILN_CHECK(handle.has_value()) << "no ATen operator " << prepared.name << " is registered with the dispatcher";
  prepared.op = *handle;
  const auto& schema_args = prepared.op->schema().arguments();
  KILN_ASSERT_EQ(schema_args.size(), node.args.size()) << "argument count of " << prepared.name;
  for (size_t i = 0; i < node.args.size(); ++i) {
    const auto position = static_cast<int32_t>(i);
    const graph::ArgValue& arg = node.args[i];
    if (auto* t = std::get_if<graph::TensorArg>(&arg)) {
      if (g.values[t->id].is_constant) {
        prepared.stack_template.emplace_back(constants[t->id]);
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
  prepared.copy_into_fresh = prepared.name == "aten::copy.default";
  // Attention's output layout depends on the kernel ATen picks at run time (flash, memory-efficient, math) and on
  // its inputs' layouts, so the recorded strides (kiln/_fake.py's guess for the whole op, kept by
  // passes/lower_attention for the kernel it names) can differ from what the run returns: every output of these
  // ops is copied into its recorded layout when they differ, since the views after it were recorded against it.
  if (graph::op_facts(prepared.name).layout == graph::OpLayout::kChosenByKernel)
    for (size_t position = 0; position < prepared.outputs.size(); ++position) restore_recorded_layout(prepared, position);
  return prepared;
}

void restore_recorded_layout(PreparedNode& node, size_t position) {
  KILN_ASSERT(position < node.outputs.size()) << node.name << " has no output " << position;
  if (std::find(node.restored_outputs.begin(), node.restored_outputs.end(), position) == node.restored_outputs.end())
    node.restored_outputs.push_back(position);
}

std::vector<c10::IValue> argument_stack(const PreparedNode& node, const graph::Graph& g,
                                        const std::vector<at::Tensor>& constants, const std::vector<at::Tensor>& env) {
  torch::jit::Stack stack = node.stack_template;
  for (const auto& slot : node.tensor_slots) stack[slot.position] = env[slot.id];
  for (const auto& slot : node.list_slots) stack[slot.position] = build_list(slot, g, constants, env);
  return stack;
}

bool prepare_out_variant(PreparedNode& node) {
  // One output only: an op with several may leave one it was told not to compute (native_layer_norm_backward's
  // output_mask), which its out= overload refuses as an out tensor.
  if (!node.op || node.returns_list || node.copy_into_fresh || node.outputs.size() != 1) return false;
  const c10::OperatorName& name = node.op->schema().operator_name();
  const auto& args = node.op->schema().arguments();
  // "out" (mm.out, add.out for add.Tensor), or the overload's name with "_out" or "out" appended
  std::vector<std::string> candidates = {"out"};
  if (!name.overload_name.empty()) candidates.insert(candidates.end(), {name.overload_name + "_out", name.overload_name + "out"});
  for (const std::string& overload : candidates) {
    auto handle = c10::Dispatcher::singleton().findSchema({name.name, overload});
    if (!handle) continue;
    const auto& out_args = handle->schema().arguments();
    if (out_args.size() != args.size() + node.outputs.size() ||
        handle->schema().returns().size() != node.outputs.size())
      continue;
    bool matches = true;
    for (size_t i = 0; i < args.size(); ++i)
      matches = matches && out_args[i].name() == args[i].name() && *out_args[i].type() == *args[i].type();
    for (size_t i = args.size(); i < out_args.size(); ++i) matches = matches && out_args[i].is_out();
    if (!matches) continue;
    // An out= overload registered only as CompositeExplicitAutograd is torchgen's wrapper for ops declared with
    // `autogen: ....out` (embedding_dense_backward.out): it runs the functional op and copies its result into `out`,
    // which costs a copy of the whole result (for a language model's embedding gradient, 131 MB each step) where
    // the functional call alone costs none. Only a kernel of the op's own (a backend's, or a composite of other ops)
    // writes into `out` directly.
    const bool own_kernel = handle->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
                            handle->hasKernelForDispatchKey(c10::DispatchKey::CUDA) ||
                            handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
    if (!own_kernel) return false;
    node.out_op = *handle;
    return true;
  }
  return false;
}

void call_node_into(const PreparedNode& node, const graph::Graph& g, const std::vector<at::Tensor>& constants,
                    std::vector<at::Tensor>& env, std::vector<at::Tensor> outs) {
  KILN_ASSERT(node.out_op.has_value()) << node.name << " has no prepared out= overload";
  KILN_ASSERT_EQ(outs.size(), node.outputs.size()) << "out tensors of " << node.name;
  torch::jit::Stack stack = argument_stack(node, g, constants, env);
  for (const at::Tensor& out : outs) stack.emplace_back(out);
  node.out_op->callBoxed(stack);
  for (size_t i = 0; i < outs.size(); ++i) env[node.outputs[i]] = std::move(outs[i]);
}

void call_node(const PreparedNode& node, const graph::Graph& g, const std::vector<at::Tensor>& constants,
               std::vector<at::Tensor>& env) {
  if (!node.op) {
    kiln_ops().at(node.name)(node.stack_template);
    return;
  }
  torch::jit::Stack stack = argument_stack(node, g, constants, env);
  if (node.copy_into_fresh && at::GradMode::is_enabled()) {  // copy(self, src, non_blocking)
    const at::Tensor& self = stack.at(0).toTensor();
    at::Tensor out = self.new_empty_strided(self.sizes(), self.strides());
    out.copy_(stack.at(1).toTensor(), stack.at(2).toBool());
    env[node.outputs.at(0)] = std::move(out);
    return;
  }
  node.op->callBoxed(stack);
  if (node.returns_list) {
    KILN_ASSERT_EQ(stack.size(), 1u) << "list-returning op " << node.name;
    std::vector<at::Tensor> items = stack[0].toTensorVector();
    KILN_ASSERT_EQ(items.size(), node.outputs.size())
        << node.name << " returned a different number of tensors than when it was captured";
    for (size_t i = 0; i < items.size(); ++i) env[node.outputs[i]] = std::move(items[i]);
  } else {
    KILN_ASSERT_EQ(stack.size(), node.outputs.size()) << "returns of " << node.name;
    for (size_t i = 0; i < stack.size(); ++i) env[node.outputs[i]] = std::move(stack[i]).toTensor();
  }
  for (size_t position : node.restored_outputs) {
    at::Tensor& out = env[node.outputs[position]];
    const graph::TensorMeta& meta = g.values[node.outputs[position]].meta;
    if (out.defined() && !same_layout(out, meta)) out = out.new_empty_strided(meta.sizes, meta.strides).copy_(out);
  }
}

}  // namespace kiln::runtime
