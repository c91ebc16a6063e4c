// The autograd bridge (see autograd_graph.h) and the meta oracle autodiff/ builds backward graphs with.
//
// Design: the joint node is a torch::autograd::Function, so the engine's own machinery does what eager
// does: edges to the inputs that require grad (AccumulateGrad for parameters), SavedVariables with
// version checks (an in-place change of a saved tensor raises as in eager), release of saved values after
// backward unless retain_graph, non-differentiable outputs. The forward runs with grad off; the backward
// conforms its inputs to the strides the compiled backward was built for (contiguous gradients).
#include "runtime/autograd_graph.h"

#include <Python.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>

#include "autodiff/build_joint_graphs.h"
#include "cache/graph_cache.h"
#include "cache/kernel_cache.h"
#include "common/error.h"
#include "common/log.h"
#include "graph/graph_bytes.h"
#include "passes/use_cudnn_batch_norm.h"
#include "runtime/eager_interpreter.h"
#include "runtime/kernel_graph.h"
#include "runtime/node_call.h"
#include "runtime/python_bridge.h"
#include "runtime/torch_info.h"

namespace kiln::runtime {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::TensorOptions options_of(const graph::TensorMeta& meta, c10::Device device) {
  return at::TensorOptions().dtype(static_cast<at::ScalarType>(meta.dtype)).device(device);
}

// Runs each emitted backward op on meta tensors shaped like its arguments: PyTorch's meta kernels give
// the results' sizes, strides and dtype.
class MetaOracle final : public graph::OpOracle {
 public:
  std::vector<graph::TensorMeta> complete_node(const graph::Graph& g, graph::Node& node) override {
    const std::string overload = node.overload == "default" ? "" : node.overload;
    auto handle = c10::Dispatcher::singleton().findSchema({node.op, overload});
    KILN_ASSERT(handle.has_value()) << "backward op " << node.qualified_name() << " is not registered";
    const c10::FunctionSchema& schema = handle->schema();
    KILN_ASSERT_EQ(schema.arguments().size(), node.args.size()) << "arguments of backward op " << node.qualified_name();
    node.arg_names.clear();
    node.num_positional = 0;
    for (const c10::Argument& a : schema.arguments()) {
      node.arg_names.push_back(a.name());
      if (!a.kwarg_only()) node.num_positional++;
      if (a.alias_info() && a.alias_info()->isWrite()) node.mutates_args = true;
    }
    for (const c10::Argument& r : schema.returns())
      if (r.alias_info()) node.is_view = true;

    const auto first_output = static_cast<graph::ValueId>(g.values.size());
    std::optional<graph::TensorMeta> first_input;
    values_.resize(g.values.size() + schema.returns().size());
    for (const graph::ArgValue& arg : node.args)
      graph::for_each_tensor(arg, [&](graph::ValueId id) {
        if (!first_input) first_input = g.values[id].meta;
        // Cached by id, so kept only while it still matches: one oracle serves several graphs (the captured
        // graph's rewrites, then the backward graph) and passes change metas (channels-last relayout).
        if (!matches(values_[id], g.values[id].meta)) values_[id] = meta_tensor(g.values[id].meta);
      });
    KILN_ASSERT(first_input.has_value()) << "backward op " << node.qualified_name() << " without tensor arguments";
    node.outputs.clear();
    for (size_t i = 0; i < schema.returns().size(); ++i) node.outputs.push_back(first_output + static_cast<graph::ValueId>(i));
    PreparedNode prepared = prepare_node(g, node, values_);
    prepared.restored_outputs.clear();  // the op's own layout is the question here; its outputs have no meta yet
    if (!answered_by_kiln_rules(prepared, g, node)) call_node(prepared, g, values_, values_);
    std::vector<graph::TensorMeta> metas;
    for (graph::ValueId out : node.outputs) {
      graph::TensorMeta meta;
      meta.device = first_input->device;
      at::Tensor& t = values_[out];
      if (t.defined()) {
        meta.sizes = t.sizes().vec();
        meta.strides = t.strides().vec();
        meta.storage_offset = t.storage_offset();
        meta.dtype = static_cast<graph::ScalarType>(t.scalar_type());
      } else {  // a masked-off result (output_mask false): never read
        meta.sizes = {0};
        meta.strides = {1};
        meta.dtype = first_input->dtype;
      }
      metas.push_back(std::move(meta));
    }
    for (graph::ValueId out : node.outputs) values_[out].reset();  // add_node assigns the real ids
    node.outputs.clear();
    return metas;
  }

 private:
  static bool matches(const at::Tensor& t, const graph::TensorMeta& meta) {
    return t.defined() && t.sizes().equals(meta.sizes) && t.strides().equals(meta.strides) &&
           t.storage_offset() == meta.storage_offset && t.scalar_type() == static_cast<at::ScalarType>(meta.dtype);
  }
  static at::Tensor meta_tensor(const graph::TensorMeta& meta) {
    at::Tensor t = at::empty_strided(meta.sizes, meta.strides, options_of(meta, c10::Device(c10::kMeta)));
    if (meta.storage_offset != 0) t = t.as_strided(meta.sizes, meta.strides, meta.storage_offset);
    return t;
  }
  // kiln's own meta rules (kiln/_meta_rules.py, oracle_infer) before torch's meta kernels: nearly all of those are
  // Python, and the first one called imports sympy (0.15-0.25 s of a training step's first call). True when a
  // rule gave the outputs (stored in values_), false when the op's meta kernel must run.
  bool answered_by_kiln_rules(const PreparedNode& prepared, const graph::Graph& g, const graph::Node& node) {
    if (!prepared.op || prepared.returns_list || !Py_IsInitialized()) return false;
    struct Gil {  // compiles hold it already; taken here too so that no caller has to
      PyGILState_STATE state = PyGILState_Ensure();
      ~Gil() { PyGILState_Release(state); }
    } gil;
    static PyObject* infer = [] {
      PyObject* rules = PyImport_ImportModule("kiln._meta_rules");
      PyObject* f = rules ? PyObject_GetAttrString(rules, "oracle_infer") : nullptr;
      Py_XDECREF(rules);
      if (!f) PyErr_Clear();
      return f;  // kept for the process
    }();
    if (!infer) return false;
    const std::vector<c10::IValue> stack = argument_stack(prepared, g, values_, values_);
    const auto& schema_args = prepared.op->schema().arguments();
    PyObject* args = PyTuple_New(node.num_positional);
    PyObject* kwargs = PyDict_New();
    bool converted = true;
    for (size_t i = 0; i < stack.size() && converted; ++i) {
      PyObject* value = argument_to_python(stack[i], *schema_args[i].real_type());  // ScalarType, not its int
      converted = value != nullptr;
      if (!converted) break;
      if (static_cast<int32_t>(i) < node.num_positional) {
        PyTuple_SET_ITEM(args, i, value);
      } else {
        PyDict_SetItemString(kwargs, schema_args[i].name().c_str(), value);
        Py_DECREF(value);
      }
    }
    PyObject* result = nullptr;
    if (converted) {
      PyObject* name = PyUnicode_FromString(node.qualified_name().c_str());
      result = PyObject_CallFunctionObjArgs(infer, name, args, kwargs, nullptr);
      Py_DECREF(name);
      if (!result) PyErr_Clear();  // a rule's surprise: torch's meta kernel decides
    }
    Py_DECREF(args);
    Py_DECREF(kwargs);
    if (!result || result == Py_None) {
      Py_XDECREF(result);
      return false;
    }
    std::vector<at::Tensor> outputs;
    auto take = [&](PyObject* item) { return tensor_or_none_from_python(item, outputs.emplace_back()); };
    bool ok = PyTuple_Check(result) ? true : take(result);
    if (PyTuple_Check(result))
      for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(result); ++i) ok = take(PyTuple_GET_ITEM(result, i));
    Py_DECREF(result);
    if (!ok || outputs.size() != node.outputs.size()) return false;
    for (size_t i = 0; i < outputs.size(); ++i) values_[node.outputs[i]] = std::move(outputs[i]);
    return true;
  }

  std::vector<at::Tensor> values_;  // meta tensors by ValueId of the graph last asked about
};

struct JointProgram final : torch::CustomClassHolder {
  autodiff::JointGraphs joint;
  std::shared_ptr<CompiledGraph> forward;
  std::shared_ptr<CompiledGraph> backward;
  // reaches[i][j]: backward output i (a captured input's gradient) depends on the gradient of differentiable output j.
  std::vector<std::vector<bool>> reaches;
  // Per joint.output_views entry: its views replayed op by op (null where the output is the input itself).
  std::vector<std::shared_ptr<CompiledGraph>> view_replays;
};

// Which gradients of the backward graph depend on which incoming output gradients (its first inputs), by walking its
// nodes in order. An input whose gradient depends only on outputs that got none (an unused output, as BERT's pooler
// output under a loss of the hidden states) gets none either, as eager's engine never reaches it: a zero gradient
// instead would give AdamW a parameter to decay that eager leaves alone.
std::vector<std::vector<bool>> gradient_reach(const graph::Graph& backward, size_t incoming) {
  std::vector<std::vector<bool>> reach(backward.values.size());
  for (size_t j = 0; j < incoming; ++j) {
    reach[backward.inputs.at(j)].assign(incoming, false);
    reach[backward.inputs[j]][j] = true;
  }
  for (const graph::Node& node : backward.nodes) {
    std::vector<bool> from(incoming, false);
    for (const graph::ArgValue& arg : node.args)
      graph::for_each_tensor(arg, [&](graph::ValueId id) {
        for (size_t j = 0; j < reach[id].size(); ++j) from[j] = from[j] || reach[id][j];
      });
    for (graph::ValueId out : node.outputs) reach[out] = from;
  }
  std::vector<std::vector<bool>> result;
  for (graph::ValueId out : backward.outputs) {
    std::vector<bool> r = reach[out];
    r.resize(incoming, false);
    result.push_back(std::move(r));
  }
  return result;
}

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
void write_back_updated_inputs(const autodiff::JointGraphs& joint, const std::vector<at::Tensor>& inputs,
                               const std::vector<at::Tensor>& results) {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < joint.updated_inputs.size(); ++i)
    inputs.at(joint.updated_inputs[i]).copy_(results.at(joint.num_outputs + i));
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

struct KilnFunction : torch::autograd::Function<KilnFunction> {
  static variable_list forward(AutogradContext* ctx, at::TensorList input_list, c10::intrusive_ptr<JointProgram> program) {
    const std::vector<at::Tensor> inputs = input_list.vec();
    const autodiff::JointGraphs& joint = program->joint;
    std::vector<at::Tensor> results = program->forward->run(inputs);
    write_back_updated_inputs(joint, inputs, results);
    variable_list outputs(results.begin(), results.begin() + static_cast<std::ptrdiff_t>(joint.num_outputs));
    // Saved values that alias an input or an output go through SavedVariables (version checks; an output held
    // by its own node would be a reference cycle). Intermediates only the backward can see are held privately,
    // so the backward can free each one after its last use, as eager frees each op's saved tensors after
    // that op's backward: holding all of them to the end costs the whole model's activations at once.
    variable_list by_reference;
    c10::List<at::Tensor> private_values;
    c10::List<int64_t> is_private;
    size_t next = joint.num_outputs + joint.updated_inputs.size();
    for (int32_t from_input : joint.saved_from_input) {
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
    for (size_t i = 0; i < joint.grad_inputs.size(); ++i) {
      const at::Tensor& input = inputs.at(joint.grad_inputs[i]);
      const graph::TensorMeta& grad = joint.backward->values[joint.backward->outputs.at(i)].meta;
      bool kept = input.defined() && input.requires_grad() && input.is_leaf() && input.sizes().equals(grad.sizes);
      for (int64_t d = 0; kept && d < input.dim(); ++d) kept = input.size(d) == 1 || input.stride(d) == grad.strides[d];
      leaf_gradients.push_back(kept);
    }
    ctx->saved_data["leaf_gradients"] = leaf_gradients;
    variable_list non_differentiable;
    for (size_t i = 0; i < outputs.size(); ++i)
      if (!joint.output_differentiable[i]) non_differentiable.push_back(outputs[i]);
    if (!non_differentiable.empty()) ctx->mark_non_differentiable(non_differentiable);
    ctx->set_materialize_grads(false);  // an output nothing used arrives undefined (backward: no gradient from it)
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    if (at::GradMode::is_enabled()) raise_double_backward();
    auto program = c10::static_intrusive_pointer_cast<JointProgram>(ctx->saved_data["program"].toCapsule());
    const autodiff::JointGraphs& joint = program->joint;
    const graph::Graph& bg = *joint.backward;
    variable_list by_reference = ctx->get_saved_variables();  // raises on a second backward without retain_graph
    std::vector<at::Tensor> private_values = ctx->saved_data["private"].toTensorVector();
    const std::vector<int64_t> is_private = ctx->saved_data["is_private"].toIntVector();
    // Without retain_graph nothing runs this node again: the private values are then ours alone to free.
    const bool consume = !torch::autograd::get_current_graph_task_keep_graph();
    if (consume) ctx->saved_data["private"] = c10::List<at::Tensor>();
    std::vector<at::Tensor> inputs;
    inputs.reserve(bg.inputs.size());
    std::vector<bool> arrived;  // per differentiable output: whether a gradient came for it
    for (size_t i = 0; i < joint.num_outputs; ++i) {
      if (!joint.output_differentiable[i]) continue;
      const graph::TensorMeta& meta = bg.values[bg.inputs[inputs.size()]].meta;
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
      inputs.push_back(conform(s, bg.values[bg.inputs[inputs.size()]].meta, !consume));
      if (consume) s.reset();
    }
    std::vector<bool> reached(joint.grad_inputs.size(), false);
    for (size_t i = 0; i < joint.grad_inputs.size(); ++i) {
      // A gradient the walk found independent of every incoming one (a structural zero written as a constant) is
      // kept whenever any gradient came: eager's engine reaches its input along the path the graph elides.
      bool depends = false;
      for (size_t j = 0; j < arrived.size(); ++j) {
        reached[i] = reached[i] || (arrived[j] && program->reaches[i][j]);
        depends = depends || program->reaches[i][j];
      }
      if (!depends) reached[i] = std::find(arrived.begin(), arrived.end(), true) != arrived.end();
    }
    // Packed (placed side by side): the gradients of leaves that are handed on. One computed but dropped (BERT's
    // unused pooler) would hold its bytes of a bucket until the bucket's last gradient is freed.
    std::vector<bool> packed = reached;
    c10::List<bool> leaves = ctx->saved_data["leaf_gradients"].toBoolList();
    for (size_t i = 0; i < packed.size(); ++i) packed[i] = packed[i] && leaves.get(i);
    std::vector<at::Tensor> grads = program->backward->run_packing(std::move(inputs), consume, packed);
    // One gradient per forward argument: the inputs (undefined where none flows), then the program.
    const size_t num_inputs = joint.forward->inputs.size();
    variable_list result(num_inputs + 1);
    for (size_t i = 0; i < joint.grad_inputs.size(); ++i)
      if (reached[i]) result[joint.grad_inputs[i]] = grads[i];
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
      write_back_updated_inputs(program_->joint, inputs, results);
      results.resize(program_->joint.num_outputs);
    }
    return with_inputs_passed_through(inputs, std::move(results));
  }
  const CompiledGraph& forward() const override { return *program_->forward; }
  const CompiledGraph& backward() const override { return *program_->backward; }
  std::vector<int32_t> updated_inputs() const override { return program_->joint.updated_inputs; }

 private:
  // The captured outputs: the computed ones, with the caller's tensors (or views of them, replayed in the caller's grad
  // mode as eager made them) where an output is an input or a view of one.
  std::vector<at::Tensor> with_inputs_passed_through(const std::vector<at::Tensor>& inputs, std::vector<at::Tensor> computed) const {
    const std::vector<int32_t>& output_inputs = program_->joint.output_inputs;
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

// ---- the joint graphs on disk ----------------------------------------------------------------------------
// After its halves' own records (kernel_graph.cpp), building the joint graphs is most of a training graph's warm
// compile (the partition, and torch's meta kernels for every backward op): a new process reads them back instead,
// keyed by the captured graph (cache::graph_key) with the torch version and cuDNN's batch-norm conditions.
constexpr const char* kJointKind = "joints";

void write_ids(graph::ByteWriter& w, const std::vector<int32_t>& ids) {
  w.integers(std::vector<int64_t>(ids.begin(), ids.end()));
}

std::vector<int32_t> read_ids(graph::ByteReader& r) {
  std::vector<int32_t> ids;
  for (int64_t v : r.integers()) ids.push_back(static_cast<int32_t>(v));
  return ids;
}

// Null when a half holds a constant the captured graph does not (then nothing is stored).
std::optional<std::string> encode_joint(const autodiff::JointGraphs& j, const graph::Graph& captured) {
  graph::ByteWriter w;
  for (const auto* half : {j.forward.get(), j.backward.get()}) {
    const std::vector<graph::ValueId> sources = cache::constant_sources(captured, *half);
    if (std::find(sources.begin(), sources.end(), cache::kUnknownConstant) != sources.end()) return std::nullopt;
    graph::write_graph(w, *half);
    write_ids(w, sources);
  }
  w.integer(static_cast<int64_t>(j.num_outputs));
  write_ids(w, j.updated_inputs);
  w.integers(std::vector<int64_t>(j.output_differentiable.begin(), j.output_differentiable.end()));
  write_ids(w, j.saved_from_input);
  write_ids(w, j.grad_inputs);
  write_ids(w, j.output_inputs);
  for (const auto& view : j.output_views) {
    w.integer(view ? 1 : 0);
    if (view) graph::write_graph(w, *view);
  }
  for (int64_t v : {j.saved_bytes, j.saved_tensors, j.saved_bytes_before_partition, j.recomputed_nodes}) w.integer(v);
  return w.take();
}

// The joint graphs stored for `captured`, with its constant tensors attached, or nullopt.
std::optional<autodiff::JointGraphs> decode_joint(const std::string& bytes, const std::string& key, const graph::Graph& captured) {
  try {
    graph::ByteReader r(bytes);
    autodiff::JointGraphs j;
    for (auto* half : {&j.forward, &j.backward}) {
      auto g = std::make_shared<graph::Graph>(graph::read_graph(r));
      if (!cache::attach_constants(*g, read_ids(r), captured)) return std::nullopt;
      g->verify();
      *half = std::move(g);
    }
    j.num_outputs = static_cast<size_t>(r.count(1 << 30));
    j.updated_inputs = read_ids(r);
    for (int64_t v : r.integers()) j.output_differentiable.push_back(v != 0);
    j.saved_from_input = read_ids(r);
    j.grad_inputs = read_ids(r);
    j.output_inputs = read_ids(r);
    for (size_t i = 0; i < j.output_inputs.size(); ++i) {
      std::shared_ptr<graph::Graph> view;
      if (r.integer() != 0) {
        view = std::make_shared<graph::Graph>(graph::read_graph(r));
        view->verify();
      }
      j.output_views.push_back(std::move(view));
    }
    for (int64_t* v : {&j.saved_bytes, &j.saved_tensors, &j.saved_bytes_before_partition, &j.recomputed_nodes}) *v = r.integer();
    KILN_CHECK(r.at_end()) << "trailing bytes";
    KILN_CHECK(j.output_differentiable.size() == j.num_outputs && j.grad_inputs.size() == j.backward->outputs.size())
        << "inconsistent joint record";
    return j;
  } catch (const std::exception& e) {
    cache::ignore_unreadable(kJointKind, key, e);
    return std::nullopt;
  }
}

}  // namespace

passes::CudnnBatchNorm cudnn_batch_norm_here() {
  passes::CudnnBatchNorm cudnn;
  const auto& hooks = at::detail::getCUDAHooks();
  cudnn.available = hooks.compiledWithCuDNN() && at::globalContext().userEnabledCuDNN();
  if (cudnn.available) cudnn.min_epsilon = hooks.batchnormMinEpsilonCuDNN();
  return cudnn;
}

std::shared_ptr<const graph::Graph> with_cudnn_batch_norm(std::shared_ptr<const graph::Graph> g) {
  const passes::CudnnBatchNorm cudnn = cudnn_batch_norm_here();
  if (!cudnn.available) return g;
  auto rewritten = std::make_shared<graph::Graph>(*g);
  MetaOracle oracle;
  at::NoGradGuard no_grad;
  if (!passes::use_cudnn_batch_norm(*rewritten, oracle, cudnn)) return g;
  return rewritten;
}

std::shared_ptr<AutogradGraph> compile_autograd_graph(std::shared_ptr<const graph::Graph> g,
                                                      const CompileGradFreeGraph& compile_part) {
  auto program = c10::make_intrusive<JointProgram>();
  const passes::CudnnBatchNorm cudnn = cudnn_batch_norm_here();
  const std::string key = cache::graph_key(*g, "joint graphs, torch " + built_torch_version() + ", cudnn batch norm " +
                                                   std::to_string(cudnn.available) + " " + std::to_string(cudnn.min_epsilon));
  std::optional<autodiff::JointGraphs> cached;
  if (std::optional<std::string> bytes = cache::load_record_bytes(kJointKind, key)) cached = decode_joint(*bytes, key, *g);
  if (cached) {
    program->joint = std::move(*cached);
    cache::stats().joint_hits++;
    KILN_LOG(perf) << "kiln autograd: forward and backward graphs found in the graph cache";
  } else {
    MetaOracle oracle;
    at::NoGradGuard no_grad;
    program->joint = autodiff::build_joint_graphs(*g, oracle, cudnn);
    if (std::optional<std::string> bytes = encode_joint(program->joint, *g)) cache::store_record_bytes(kJointKind, key, *bytes);
  }
  const autodiff::JointGraphs& joint = program->joint;
  KILN_LOG(graph) << "kiln autograd partition: saves " << joint.saved_tensors << " tensors (" << joint.saved_bytes
                  << " bytes), recomputes " << joint.recomputed_nodes << " nodes; was "
                  << joint.saved_bytes_before_partition << " bytes";
  KILN_LOG(graph) << "kiln autograd: forward\n" << joint.forward->to_string() << "backward\n" << joint.backward->to_string();
  size_t incoming = 0;
  for (bool differentiable : joint.output_differentiable) incoming += differentiable;
  program->reaches = gradient_reach(*joint.backward, incoming);
  KILN_ASSERT_EQ(program->reaches.size(), joint.grad_inputs.size()) << "backward outputs";
  for (const auto& view : joint.output_views)
    program->view_replays.push_back(view ? make_eager_interpreter(view, {}) : nullptr);
  const log::Stopwatch forward_started;
  program->forward = compile_part(joint.forward);
  const double forward_ms = forward_started.ms();
  const log::Stopwatch backward_started;
  program->backward = compile_part(joint.backward);
  KILN_LOG(perf) << "kiln autograd: forward compiled in " << log::whole_ms(forward_ms) << " ms, backward in "
                 << log::whole_ms(backward_started.ms()) << " ms";
  kiln_backend_stats().autograd_saved_bytes += joint.saved_bytes;
  kiln_backend_stats().autograd_recomputed_nodes += joint.recomputed_nodes;
  return std::make_shared<JointGraph>(std::move(program));
}

}  // namespace kiln::runtime
