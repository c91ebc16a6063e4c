// The autograd bridge (see autograd_graph.h): the two compiled halves behind one autograd node.
//
// Design: the joint node is a torch::autograd::Function, so the engine's own machinery does what eager
// does: edges to the inputs that require grad (AccumulateGrad for parameters), SavedVariables with
// version checks (an in-place change of a saved tensor raises as in eager), release of saved values after
// backward unless retain_graph, non-differentiable outputs. The forward runs with grad off; the backward
// conforms its inputs to the strides the compiled backward was built for (contiguous gradients).
#include "runtime/autograd_graph.h"

#include <Python.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>

#include "common/error.h"
#include "passes/use_cudnn_batch_norm.h"
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

[[noreturn]] void raise_double_backward() {
  const char* message =
      "double backward through a kiln-compiled graph is not supported; compile without kiln or use "
      "torch.autograd.grad on the eager function";
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

using TensorHooks = std::vector<std::unique_ptr<torch::autograd::FunctionPreHook>>;

// The leaf inputs with tensor hooks (`register_hook`), by gradient slot: what set_aside_unreached_hooks may need.
void save_hooked_leaves(AutogradContext* ctx, const AutogradSignature& signature, const std::vector<at::Tensor>& inputs) {
  c10::List<int64_t> slots;
  c10::List<at::Tensor> leaves;
  for (size_t i = 0; i < signature.grad_inputs.size(); ++i) {
    const at::Tensor& input = inputs.at(signature.grad_inputs[i]);
    if (input.defined() && input.requires_grad() && input.is_leaf() && !torch::autograd::impl::hooks(input).empty()) {
      slots.push_back(static_cast<int64_t>(i));
      leaves.push_back(input);
    }
  }
  if (slots.empty()) return;
  ctx->saved_data["hooked_slots"] = slots;
  ctx->saved_data["hooked_leaves"] = leaves;
}

// A leaf no incoming gradient reached (an unused head's weight) is never reached by eager's engine, so its hooks never
// run; this node has an edge to its AccumulateGrad all the same, which the engine takes with an undefined gradient,
// calling the leaf's tensor hooks with None (a hook `lambda g: g * 2` raises). Such a leaf's hooks are set aside, and
// put back when the backward pass ends.
void set_aside_unreached_hooks(AutogradContext* ctx, const std::vector<bool>& reached) {
  auto it = ctx->saved_data.find("hooked_slots");
  if (it == ctx->saved_data.end()) return;
  const std::vector<int64_t> slots = it->second.toIntVector();
  const std::vector<at::Tensor> leaves = ctx->saved_data["hooked_leaves"].toTensorVector();
  for (size_t k = 0; k < slots.size(); ++k) {
    if (reached.at(static_cast<size_t>(slots[k]))) continue;
    TensorHooks& hooks = torch::autograd::impl::hooks(leaves[k]);
    if (hooks.empty()) continue;
    auto held = std::make_shared<TensorHooks>(std::move(hooks));
    hooks.clear();
    torch::autograd::Engine::get_default_engine().queue_callback([leaf = leaves[k], held] {
      TensorHooks& now = torch::autograd::impl::hooks(leaf);  // the set-aside hooks first, then any added since
      for (auto& hook : now) held->push_back(std::move(hook));
      now = std::move(*held);
    });
  }
}

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
    save_hooked_leaves(ctx, signature, inputs);
    variable_list non_differentiable;
    for (size_t i = 0; i < outputs.size(); ++i)
      if (!signature.output_differentiable[i]) non_differentiable.push_back(outputs[i]);
    if (!non_differentiable.empty()) ctx->mark_non_differentiable(non_differentiable);
    ctx->set_materialize_grads(false);  // an output nothing used arrives undefined (backward: no gradient from it)
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    if (at::GradMode::is_enabled()) raise_double_backward();
    auto program = c10::static_intrusive_pointer_cast<JointProgram>(ctx->saved_data["program"].toCapsule());
    const AutogradSignature& signature = program->signature;
    variable_list by_reference = ctx->get_saved_variables();  // raises on a second backward without retain_graph
    std::vector<at::Tensor> private_values = ctx->saved_data["private"].toTensorVector();
    const std::vector<int64_t> is_private = ctx->saved_data["is_private"].toIntVector();
    // Without retain_graph nothing runs this node again: the private values are then ours alone to free.
    const bool consume = !torch::autograd::get_current_graph_task_keep_graph();
    if (consume) ctx->saved_data["private"] = c10::List<at::Tensor>();
    std::vector<at::Tensor> inputs;
    inputs.reserve(signature.backward_inputs.size());
    std::vector<bool> arrived;  // per differentiable output: whether a gradient came for it
    for (size_t i = 0; i < signature.num_outputs; ++i) {
      if (!signature.output_differentiable[i]) continue;
      const graph::TensorMeta& meta = signature.backward_inputs.at(inputs.size());
      arrived.push_back(grad_outputs[i].defined());
      if (grad_outputs[i].defined()) {
        inputs.push_back(conform(grad_outputs[i], meta, false));
      } else {
        inputs.push_back(at::empty_strided(meta.sizes, meta.strides, options_of(meta, to_c10(meta.device))).zero_());
      }
    }
    grad_outputs.clear();
    size_t next_reference = 0, next_private = 0;
    for (int64_t kind : is_private) {
      at::Tensor& s = kind ? private_values.at(next_private++) : by_reference.at(next_reference++);
      inputs.push_back(conform(s, signature.backward_inputs.at(inputs.size()), !consume));
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
    set_aside_unreached_hooks(ctx, reached);
    // Packed (placed side by side): the gradients of leaves that are handed on. One computed but dropped (BERT's
    // unused pooler) would hold its bytes of a bucket until the bucket's last gradient is freed.
    std::vector<bool> packed = reached;
    c10::List<bool> leaves = ctx->saved_data["leaf_gradients"].toBoolList();
    for (size_t i = 0; i < packed.size(); ++i) packed[i] = packed[i] && leaves.get(i);
    std::vector<at::Tensor> grads = program->backward->run_packing(std::move(inputs), consume, packed);
    autograd_backward_runs()++;
    // One gradient per forward argument: the inputs (undefined where none flows), then the program.
    const size_t num_inputs = signature.num_inputs;
    variable_list result(num_inputs + 1);
    for (size_t i = 0; i < signature.grad_inputs.size(); ++i)
      if (reached[i]) result[signature.grad_inputs[i]] = grads[i];
    return result;
  }
};

class JointGraph final : public AutogradGraph {
 public:
  explicit JointGraph(c10::intrusive_ptr<JointProgram> program) : program_(std::move(program)) {}

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) override {
    bool needs_grad = false;
    if (at::GradMode::is_enabled())
      for (const at::Tensor& t : inputs) needs_grad = needs_grad || (t.defined() && t.requires_grad());
    std::vector<at::Tensor> results;
    if (needs_grad) {
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
                                                   std::vector<std::shared_ptr<CompiledGraph>> view_replays) {
  auto program = c10::make_intrusive<JointProgram>();
  program->signature = std::move(signature);
  program->forward = std::move(forward);
  program->backward = std::move(backward);
  program->view_replays = std::move(view_replays);
  return std::make_shared<JointGraph>(std::move(program));
}

}  // namespace kiln::runtime
