// The autograd bridge (see autograd_graph.h): the two compiled halves behind one autograd node.
//
// Design: the joint node is a torch::autograd::Function, so the engine's own machinery does what eager
// does: edges to the inputs that require grad (AccumulateGrad for parameters), SavedVariables with
// version checks (an in-place change of a saved tensor raises as in eager), release of saved values after
// backward unless retain_graph, non-differentiable outputs. The forward runs with grad off; the backward
// conforms its inputs to the strides the compiled backward was built for (contiguous gradients).
#include "runtime/autograd_graph.h"

#include <Python.h>
#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <typeinfo>

#include <ATen/ops/empty_strided.h>
#include <c10/core/GradMode.h>
#include <c10/util/Type.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/cpp_hook.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "common/error.h"
#include "common/log.h"
#include "passes/use_cudnn_batch_norm.h"
#include "runtime/double_backward.h"
#include "runtime/node_call.h"

namespace kiln::runtime {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::TensorOptions options_of(const graph::TensorMeta& meta, c10::Device device) {
  return at::TensorOptions().dtype(static_cast<at::ScalarType>(meta.dtype)).device(device);
}

struct JointProgram final : torch::CustomClassHolder {
  AutogradSignature signature;
  std::shared_ptr<CompiledGraph> forward;
  std::shared_ptr<CompiledGraph> backward;
  // Per signature.output_inputs entry: its views replayed op by op (null where the output is the input itself).
  std::vector<std::shared_ptr<CompiledGraph>> view_replays;
  // What a backward under create_graph=True replays (double_backward.h), or null; replay_refusal says why not then.
  std::shared_ptr<DoubleBackwardReplay> replay;
  std::string replay_refusal;
  std::vector<size_t> computed_outputs;  // the captured graph's output that each computed output is

  // The backward for gradients that do not come (make_autograd_graph): per pattern of absent gradients, its compiled
  // backward, or null where compiling it failed or could not be done.
  CompileBackwardWithout compile_without;
  std::mutex variants_mutex;
  std::map<std::vector<bool>, std::shared_ptr<CompiledGraph>> variants;
  std::vector<bool> wanted;  // a pattern a backward met with no variant: compiled by the next forward

  // The variant for `absent`, or null (noting the pattern for the next forward when it is new).
  std::shared_ptr<CompiledGraph> variant_for(const std::vector<bool>& absent) {
    std::lock_guard<std::mutex> lock(variants_mutex);
    auto found = variants.find(absent);
    if (found != variants.end()) return found->second;
    if (compile_without && variants.size() < kMaxBackwardVariants) wanted = absent;
    return nullptr;
  }

  // Compiles the pattern a backward asked for, if any (with the GIL: the compiles kiln runs in a forward).
  void compile_wanted_variant() {
    std::vector<bool> absent;
    {
      std::lock_guard<std::mutex> lock(variants_mutex);
      if (wanted.empty()) return;
      absent = std::move(wanted);
      wanted.clear();
      if (!variants.emplace(absent, nullptr).second) return;
    }
    std::shared_ptr<CompiledGraph> compiled;
    PyGILState_STATE gil = PyGILState_Ensure();
    try {
      compiled = compile_without(absent);
    } catch (const std::exception& e) {
      KILN_LOG(fallbacks) << "kiln autograd: the backward without the gradients that did not come was not compiled "
                             "(they stay zero fills): "
                          << e.what();
    }
    PyGILState_Release(gil);
    std::lock_guard<std::mutex> lock(variants_mutex);
    variants[absent] = std::move(compiled);
  }
};

// A tensor with exactly the sizes and strides `meta` promises (copied only when it differs). A workspace
// (passes::is_opaque_workspace: cuDNN's batch-norm reserve) has the size its kernel chose and passes as it
// is; `keep` (retain_graph: another backward will read it) passes a copy, as eager's formula does.
at::Tensor conform(const at::Tensor& t, const graph::TensorMeta& meta, bool keep) {
  if (passes::is_opaque_workspace(meta) && t.scalar_type() == at::kByte && t.dim() == 1) return keep ? t.clone() : t;
  const auto dtype = static_cast<at::ScalarType>(meta.dtype);
  if (t.sizes().equals(meta.sizes) && t.strides().equals(meta.strides) && t.scalar_type() == dtype) return t;
  at::Tensor copy = at::empty_strided(meta.sizes, meta.strides, t.options().dtype(dtype));
  copy.copy_(t);
  return copy;
}

// The forward's buffer updates (passes/functionalize_buffer_updates.h) land in the caller's tensors, as
// eager's in-place ops would have written them (same storage, version counter bumped).
void write_back_updated_inputs(const AutogradSignature& signature, const std::vector<at::Tensor>& inputs,
                               const std::vector<at::Tensor>& results) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < signature.updated_inputs.size(); ++i)
    inputs.at(signature.updated_inputs[i]).copy_(results.at(signature.num_outputs + i));
}

[[noreturn]] void raise_double_backward(const std::string& why) {
  const std::string text = "double backward (a backward with create_graph=True) through this kiln-compiled graph is "
                           "not supported: " + why + "; run this part eagerly (kiln.disable) for it";
  const char* message = text.c_str();
  {
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject* errors = PyImport_ImportModule("kiln.errors");
    PyObject* type = errors ? PyObject_GetAttrString(errors, "KilnError") : nullptr;
    if (type) {
      PyErr_SetString(type, message);
    } else {
      PyErr_SetString(PyExc_RuntimeError, message);
    }
    Py_XDECREF(type);
    Py_XDECREF(errors);
    python_error err;
    err.persist();
    PyGILState_Release(gil);
    throw std::move(err);
  }
}

// Gates, for the rest of this backward pass, the tensor hooks at the end of each edge of the current kiln node that
// `result` (its backward's gradients, one per input) hands no gradient; see "Inputs no gradient reaches" below.
void gate_unreached_inputs(const variable_list& result, size_t num_inputs);

struct KilnFunction : torch::autograd::Function<KilnFunction> {
  static variable_list forward(AutogradContext* ctx, at::TensorList input_list, c10::intrusive_ptr<JointProgram> program) {
    const std::vector<at::Tensor> inputs = input_list.vec();
    const AutogradSignature& signature = program->signature;
    std::vector<at::Tensor> results = program->forward->run(inputs);
    write_back_updated_inputs(signature, inputs, results);
    variable_list outputs(results.begin(), results.begin() + static_cast<std::ptrdiff_t>(signature.num_outputs));
    // Saved values that alias an input or an output go through SavedVariables (version checks; an output held
    // by its own node would be a reference cycle). Intermediates only the backward can see are held privately,
    // so the backward can free each one after its last use, as eager frees each op's saved tensors after
    // that op's backward: holding all of them to the end costs the whole model's activations at once.
    variable_list by_reference;
    c10::List<at::Tensor> private_values;
    c10::List<int64_t> is_private;
    size_t next = signature.num_outputs + signature.updated_inputs.size();
    for (int32_t from_input : signature.saved_from_input) {
      at::Tensor value = from_input >= 0 ? inputs[from_input] : results.at(next++);
      bool aliases = from_input >= 0;
      for (const at::Tensor& out : outputs) aliases = aliases || out.unsafeGetTensorImpl() == value.unsafeGetTensorImpl();
      is_private.push_back(aliases ? 0 : 1);
      if (aliases) {
        by_reference.push_back(std::move(value));
      } else {
        private_values.push_back(std::move(value));
      }
    }
    results.clear();
    ctx->save_for_backward(by_reference);
    ctx->saved_data["private"] = private_values;
    ctx->saved_data["is_private"] = is_private;
    ctx->saved_data["program"] = c10::IValue::make_capsule(program);
    // Which gradients AccumulateGrad will keep as they come (a leaf's, laid out as the leaf is: it clones any
    // other, which would leave the original's bytes unused in a bucket): the backward places those side by side.
    c10::List<bool> leaf_gradients;
    for (size_t i = 0; i < signature.grad_inputs.size(); ++i) {
      const at::Tensor& input = inputs.at(signature.grad_inputs[i]);
      const graph::TensorMeta& grad = signature.backward_outputs.at(i);
      bool kept = input.defined() && input.requires_grad() && input.is_leaf() && input.sizes().equals(grad.sizes);
      for (int64_t d = 0; kept && d < input.dim(); ++d) kept = input.size(d) == 1 || input.stride(d) == grad.strides[d];
      leaf_gradients.push_back(kept);
    }
    ctx->saved_data["leaf_gradients"] = leaf_gradients;
    if (program->replay) {
      // For a backward under create_graph=True, which replays the graph on these inputs (double_backward.h).
      c10::List<int64_t> versions;
      for (const at::Tensor& input : inputs) versions.push_back(input.defined() ? input._version() : 0);
      ctx->saved_data["inputs"] = c10::List<at::Tensor>(inputs);
      ctx->saved_data["input_versions"] = versions;
    }
    variable_list non_differentiable;
    for (size_t i = 0; i < outputs.size(); ++i)
      if (!signature.output_differentiable[i]) non_differentiable.push_back(outputs[i]);
    if (!non_differentiable.empty()) ctx->mark_non_differentiable(non_differentiable);
    ctx->set_materialize_grads(false);  // an output nothing used arrives undefined (backward: no gradient from it)
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto program = c10::static_intrusive_pointer_cast<JointProgram>(ctx->saved_data["program"].toCapsule());
    const AutogradSignature& signature = program->signature;
    if (at::GradMode::is_enabled()) return double_backward(ctx, *program, grad_outputs);
    // No gradient came at all: the engine reached this node only by edges that carry none (see "Inputs no gradient
    // reaches"), where eager runs none of these ops' backward; its outputs' hooks were not run either (FSDP2's unshards
    // the parameters this backward would read).
    if (std::none_of(grad_outputs.begin(), grad_outputs.end(), [](const at::Tensor& grad) { return grad.defined(); })) {
      variable_list result(signature.num_inputs + 1);
      gate_unreached_inputs(result, signature.num_inputs);
      return result;
    }
    variable_list by_reference = ctx->get_saved_variables();  // raises on a second backward without retain_graph
    std::vector<at::Tensor> private_values = ctx->saved_data["private"].toTensorVector();
    const std::vector<int64_t> is_private = ctx->saved_data["is_private"].toIntVector();
    // Without retain_graph nothing runs this node again: the private values are then ours alone to free.
    const bool consume = !torch::autograd::get_current_graph_task_keep_graph();
    if (consume) {
      ctx->saved_data["private"] = c10::List<at::Tensor>();
      ctx->saved_data.erase("inputs");
    }
    std::vector<bool> arrived;  // per differentiable output: whether a gradient came for it
    for (size_t i = 0; i < signature.num_outputs; ++i)
      if (signature.output_differentiable[i]) arrived.push_back(grad_outputs[i].defined());
    std::shared_ptr<CompiledGraph> variant;  // the backward without the gradients that did not come
    if (std::find(arrived.begin(), arrived.end(), false) != arrived.end()) {
      std::vector<bool> absent(arrived.size());
      for (size_t j = 0; j < arrived.size(); ++j) absent[j] = !arrived[j];
      variant = program->variant_for(absent);
    }
    std::vector<at::Tensor> inputs;
    inputs.reserve(signature.backward_inputs.size());
    size_t next_input = 0;  // the backward's input (of the graph built for every gradient) being conformed
    for (size_t i = 0; i < signature.num_outputs; ++i) {
      if (!signature.output_differentiable[i]) continue;
      const graph::TensorMeta& meta = signature.backward_inputs.at(next_input++);
      if (grad_outputs[i].defined()) {
        inputs.push_back(conform(grad_outputs[i], meta, false));
      } else if (!variant) {
        inputs.push_back(at::empty_strided(meta.sizes, meta.strides, options_of(meta, to_c10(meta.device))).zero_());
      }
    }
    grad_outputs.clear();
    size_t next_reference = 0, next_private = 0;
    for (int64_t kind : is_private) {
      at::Tensor& s = kind ? private_values.at(next_private++) : by_reference.at(next_reference++);
      inputs.push_back(conform(s, signature.backward_inputs.at(next_input++), !consume));
      if (consume) s.reset();
    }
    std::vector<bool> reached(signature.grad_inputs.size(), false);
    for (size_t i = 0; i < signature.grad_inputs.size(); ++i) {
      // A gradient the walk found independent of every incoming one (a structural zero written as a constant) is
      // kept whenever any gradient came: eager's engine reaches its input along the path the graph elides.
      bool depends = false;
      for (size_t j = 0; j < arrived.size(); ++j) {
        reached[i] = reached[i] || (arrived[j] && signature.reaches[i][j]);
        depends = depends || signature.reaches[i][j];
      }
      if (!depends) reached[i] = std::find(arrived.begin(), arrived.end(), true) != arrived.end();
    }
    // Packed (placed side by side): the gradients of leaves that are handed on. One computed but dropped (BERT's
    // unused pooler) would hold its bytes of a bucket until the bucket's last gradient is freed.
    std::vector<bool> packed = reached;
    c10::List<bool> leaves = ctx->saved_data["leaf_gradients"].toBoolList();
    for (size_t i = 0; i < packed.size(); ++i) packed[i] = packed[i] && leaves.get(i);
    std::vector<at::Tensor> grads = (variant ? variant : program->backward)->run_packing(std::move(inputs), consume, packed);
    autograd_backward_runs()++;
    // One gradient per forward argument: the inputs (undefined where none flows), then the program.
    const size_t num_inputs = signature.num_inputs;
    variable_list result(num_inputs + 1);
    for (size_t i = 0; i < signature.grad_inputs.size(); ++i)
      if (reached[i]) result[signature.grad_inputs[i]] = grads[i];
    gate_unreached_inputs(result, num_inputs);
    return result;
  }

  // A backward under create_graph=True: the captured graph replayed on the forward's inputs and differentiated with
  // autograd recording (double_backward.h).
  static variable_list double_backward(AutogradContext* ctx, JointProgram& program, const variable_list& grad_outputs) {
    if (!program.replay) raise_double_backward(program.replay_refusal);
    ctx->get_saved_variables();  // raises eager's error on a backward after one without retain_graph
    auto saved = ctx->saved_data.find("inputs");
    if (saved == ctx->saved_data.end())
      raise_double_backward("its saved inputs were freed by an earlier backward (use retain_graph=True there)");
    const std::vector<at::Tensor> inputs = saved->second.toTensorVector();
    const std::vector<int64_t> versions = ctx->saved_data["input_versions"].toIntVector();
    std::vector<at::Tensor> grads = program.replay->gradients(inputs, versions, grad_outputs, program.computed_outputs,
                                                              program.signature.grad_inputs);
    if (!torch::autograd::get_current_graph_task_keep_graph()) ctx->saved_data.erase("inputs");
    variable_list result(grads.begin(), grads.end());
    result.emplace_back();  // the program
    gate_unreached_inputs(result, program.signature.num_inputs);
    return result;
  }
};

// Inputs no gradient reaches. The node has an edge to every input that requires grad, and the engine follows each one
// even where backward hands it no gradient: the node at its end (the input's grad_fn, or a leaf's AccumulateGrad) runs
// with an undefined gradient and calls the input's tensor hooks (`register_hook`) with None, then hands undefined
// gradients on to the nodes it came from, whose hooks get None too. Eager's engine never gets there: the ops of an
// output the loss ignores (or of a use with no gradient, a mask) are not in its graph. Whether some other path (eager
// code, another compiled node) brings the same node a gradient is known only when that node runs, after the engine has
// summed every path into it; setting its hooks aside from here would skip them where eager calls them once, with that
// sum. So the node at the end of such an edge gets, for the rest of the pass, one UnreachedGate in place of its tensor
// hooks, which decides when the node runs: every incoming gradient undefined (no path eager has reaches the node) calls
// none of them and gates the nodes it hands on to; otherwise they run as the engine would run them. A kiln node stands
// for many eager ops, each with its own grad_fn, so there the gate also skips the hooks of each output no gradient
// reached (register_hook in compiled code breaks the graph there: the hooked tensor is the previous graph's output).
// Left as they are: a node's own pre- and post-hooks and a parameter's post-accumulate-grad hooks still run at such an
// edge's end (DDP's reducer counts on its AccumulateGrad post-hook for every parameter this node reaches). Not
// reachable from here: register_multi_grad_hook(mode="all") counts such a node among those the engine runs, and
// waits for its hook.

using torch::autograd::FunctionPreHook;
using torch::autograd::Node;
using TensorHooks = std::vector<std::unique_ptr<FunctionPreHook>>;
// Whichever pointer type this torch's edges hold (std::shared_ptr before torch 2.12, c10::intrusive_ptr after), and its
// weak counterpart.
using NodePtr = decltype(torch::autograd::Edge::function);
template <class P>
struct WeakOf;
template <class T>
struct WeakOf<std::shared_ptr<T>> {
  using type = std::weak_ptr<T>;
};
template <class T>
struct WeakOf<c10::intrusive_ptr<T>> {
  using type = c10::weak_intrusive_ptr<T>;
};
using WeakNodePtr = typename WeakOf<NodePtr>::type;

bool is_kiln_node(const Node& node) {
  return dynamic_cast<const torch::autograd::CppNode<KilnFunction>*>(&node) != nullptr;
}

// The gradient slot of its node a tensor hook reads, or -1 where the hook is not one register_hook makes (from Python
// or C++). LibTorch exports no typeinfo for those classes, so the class is told by its name.
int64_t slot_of(const FunctionPreHook& hook) {
  const std::string name = c10::demangle(typeid(hook).name());
  if (name == "torch::autograd::PyFunctionTensorPreHook")
    return static_cast<int64_t>(static_cast<const torch::autograd::PyFunctionTensorPreHook&>(hook).value_idx);
  if (name == "torch::autograd::CppFunctionTensorPreHook")
    return static_cast<int64_t>(static_cast<const torch::autograd::CppFunctionTensorPreHook&>(hook).value_idx_);
  return -1;
}

void gate_for_pass(const NodePtr& node);

// A node's tensor hooks, held while backward passes that gated the node run (see above).
class UnreachedGate final : public FunctionPreHook {
 public:
  UnreachedGate(const NodePtr& node, TensorHooks held) : node_(node), held_(std::move(held)) {
    if (is_kiln_node(*node))
      for (const auto& hook : held_) slots_.push_back(slot_of(*hook));
  }

  variable_list operator()(const variable_list& grads) override {
    if (std::none_of(grads.begin(), grads.end(), [](const at::Tensor& grad) { return grad.defined(); })) {
      if (NodePtr node = node_.lock())
        for (const torch::autograd::Edge& edge : node->next_edges())
          if (edge.is_valid()) gate_for_pass(edge.function);
      return grads;
    }
    variable_list result = grads;
    for (size_t i = 0; i < held_.size(); ++i) {
      const int64_t slot = slots_.empty() ? -1 : slots_[i];
      const bool reached = slot < 0 || static_cast<size_t>(slot) >= result.size() || result[slot].defined();
      if (reached) result = (*held_[i])(result);
    }
    return result;
  }

  // Whether `pass` is new to this gate (a node reached by several edges without a gradient is gated once per pass).
  bool join(int pass) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (std::find(passes_.begin(), passes_.end(), pass) != passes_.end()) return false;
    passes_.push_back(pass);
    return true;
  }
  // Whether `pass` was the last one holding the hooks.
  bool leave(int pass) {
    std::lock_guard<std::mutex> lock(mutex_);
    passes_.erase(std::remove(passes_.begin(), passes_.end(), pass), passes_.end());
    return passes_.empty();
  }
  TensorHooks release() { return std::move(held_); }

 private:
  WeakNodePtr node_;  // weak: the gate lives in the node's own hooks
  TensorHooks held_;
  std::vector<int64_t> slots_;  // at a kiln node, per held hook: the output it hooks (-1: unknown, run if any is)
  std::mutex mutex_;
  std::vector<int> passes_;  // graph task ids
};

UnreachedGate* find_gate(TensorHooks& hooks) {
  for (const auto& hook : hooks)
    if (auto* gate = dynamic_cast<UnreachedGate*>(hook.get())) return gate;
  return nullptr;
}

// The node's hooks back in the gate's place once no pass holds them (hooks added meanwhile stay after them). A pass
// that ends in an error runs no callbacks: its gate stays, and still calls the hooks wherever a gradient arrives.
void ungate(const NodePtr& node, int pass) {
  TensorHooks& hooks = node->tensor_pre_hooks();
  UnreachedGate* gate = find_gate(hooks);
  if (!gate || !gate->leave(pass)) return;
  TensorHooks held = gate->release();
  auto at = hooks.erase(std::find_if(hooks.begin(), hooks.end(), [&](const auto& hook) { return hook.get() == gate; }));
  hooks.insert(at, std::make_move_iterator(held.begin()), std::make_move_iterator(held.end()));
}

void gate_for_pass(const NodePtr& node) {
  TensorHooks& hooks = node->tensor_pre_hooks();
  UnreachedGate* gate = find_gate(hooks);
  if (!gate) {
    if (hooks.empty() && node->next_edges().empty()) return;  // a leaf without hooks: nothing to hold or hand on
    auto made = std::make_unique<UnreachedGate>(node, std::move(hooks));
    gate = made.get();
    hooks.clear();
    hooks.push_back(std::move(made));
  }
  const int pass = torch::autograd::get_current_graph_task_id();
  if (!gate->join(pass)) return;
  torch::autograd::Engine::get_default_engine().queue_callback([node, pass] { ungate(node, pass); });
}

void gate_unreached_inputs(const variable_list& result, size_t num_inputs) {
  // Outside the engine (a node called by hand) nothing follows the edges, and there is no pass to end.
  if (torch::autograd::get_current_graph_task_id() < 0) return;
  const NodePtr node = torch::autograd::get_current_node();
  if (!node || !is_kiln_node(*node)) return;
  KILN_ASSERT_EQ(node->num_outputs(), num_inputs);
  for (size_t i = 0; i < num_inputs; ++i)
    if (!result[i].defined() && node->next_edge(i).is_valid()) gate_for_pass(node->next_edge(i).function);
}

class JointGraph final : public AutogradGraph {
 public:
  explicit JointGraph(c10::intrusive_ptr<JointProgram> program) : program_(std::move(program)) {}

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) override {
    bool needs_grad = false;
    if (at::GradMode::is_enabled())
      for (const at::Tensor& t : inputs) needs_grad = needs_grad || (t.defined() && t.requires_grad());
    std::vector<at::Tensor> results;
    if (needs_grad && program_->replay && program_->replay->used()) {
      // Trained with double backward: the replay's eager history serves both backwards (double_backward.h).
      return program_->replay->record_forward(inputs);
    }
    if (needs_grad) {
      program_->compile_wanted_variant();
      // A TensorList (not a vector) so that Function::apply sees each input as a variable.
      results = KilnFunction::apply(at::TensorList(inputs), program_);
    } else {
      results = program_->forward->run(inputs);
      write_back_updated_inputs(program_->signature, inputs, results);
      results.resize(program_->signature.num_outputs);
    }
    return with_inputs_passed_through(inputs, std::move(results));
  }
  const CompiledGraph& forward() const override { return *program_->forward; }
  bool reenters_python() const override { return program_->forward->reenters_python(); }
  const CompiledGraph& backward() const override { return *program_->backward; }
  std::vector<int32_t> updated_inputs() const override { return program_->signature.updated_inputs; }
  std::string cudagraph_status() const override {
    const std::string forward = program_->forward->cudagraph_status();
    const std::string backward = program_->backward->cudagraph_status();
    if (forward.empty() && backward.empty()) return "";
    return "forward: " + (forward.empty() ? std::string("not recorded") : forward) +
           "; backward: " + (backward.empty() ? std::string("not recorded") : backward);
  }

 private:
  // The captured outputs: the computed ones, with the caller's tensors (or views of them, replayed in the caller's grad
  // mode as eager made them) where an output is an input or a view of one.
  std::vector<at::Tensor> with_inputs_passed_through(const std::vector<at::Tensor>& inputs, std::vector<at::Tensor> computed) const {
    const std::vector<int32_t>& output_inputs = program_->signature.output_inputs;
    if (output_inputs.empty()) return computed;
    std::vector<at::Tensor> outputs;
    outputs.reserve(output_inputs.size());
    size_t next = 0;
    for (size_t i = 0; i < output_inputs.size(); ++i) {
      const int32_t input = output_inputs[i];
      if (input < 0) {
        outputs.push_back(std::move(computed.at(next++)));
      } else if (const auto& replay = program_->view_replays.at(i)) {
        outputs.push_back(replay->run({inputs.at(input)}).at(0));
      } else {
        outputs.push_back(inputs.at(input));
      }
    }
    return outputs;
  }

  c10::intrusive_ptr<JointProgram> program_;
};

}  // namespace

std::atomic<int64_t>& autograd_backward_runs() {
  static std::atomic<int64_t> runs{0};
  return runs;
}

std::shared_ptr<AutogradGraph> make_autograd_graph(AutogradSignature signature, std::shared_ptr<CompiledGraph> forward,
                                                   std::shared_ptr<CompiledGraph> backward,
                                                   std::vector<std::shared_ptr<CompiledGraph>> view_replays,
                                                   CompileBackwardWithout compile_without,
                                                   std::shared_ptr<DoubleBackwardReplay> replay) {
  auto program = c10::make_intrusive<JointProgram>();
  // The replay for double backward, where it would compute what the forward computed.
  if (!replay) {
    program->replay_refusal = "the graph was compiled without its replay";
  } else if (!replay->refusal().empty()) {
    program->replay_refusal = replay->refusal();
  } else if (!signature.updated_inputs.empty()) {
    program->replay_refusal = "the graph updates its inputs in place, which a replay would read updated";
  } else {
    for (size_t i = 0; i < std::max(signature.output_inputs.size(), signature.num_outputs); ++i)
      if (signature.output_inputs.empty() || signature.output_inputs[i] < 0) program->computed_outputs.push_back(i);
    if (program->computed_outputs.size() == signature.num_outputs &&
        replay->num_graph_outputs() == std::max(signature.output_inputs.size(), signature.num_outputs)) {
      program->replay = std::move(replay);
    } else {
      program->replay_refusal = "its outputs are not the captured graph's";
    }
  }
  program->compile_without = std::move(compile_without);
  program->signature = std::move(signature);
  program->forward = std::move(forward);
  program->backward = std::move(backward);
  program->view_replays = std::move(view_replays);
  return std::make_shared<JointGraph>(std::move(program));
}

}  // namespace kiln::runtime
