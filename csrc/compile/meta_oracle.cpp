// The OpOracle over the running torch (meta_oracle.h): kiln's Python meta rules first, then torch's meta kernels
// through runtime/'s prepared dispatcher calls on meta tensors.
#include "compile/meta_oracle.h"

#include <Python.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/empty_strided.h>

#include <optional>
#include <string>

#include "common/error.h"
#include "runtime/node_call.h"
#include "runtime/python_bridge.h"

namespace kiln::compile {

namespace {

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
    runtime::PreparedNode prepared = runtime::prepare_node(g, node, values_);
    prepared.restored_outputs.clear();  // the op's own layout is the question here; its outputs have no meta yet
    if (!answered_by_kiln_rules(prepared, g, node)) runtime::call_node(prepared, g, values_, values_);
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
  bool answered_by_kiln_rules(const runtime::PreparedNode& prepared, const graph::Graph& g, const graph::Node& node) {
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
    const std::vector<c10::IValue> stack = runtime::argument_stack(prepared, g, values_, values_);
    const auto& schema_args = prepared.op->schema().arguments();
    PyObject* args = PyTuple_New(node.num_positional);
    PyObject* kwargs = PyDict_New();
    bool converted = true;
    for (size_t i = 0; i < stack.size() && converted; ++i) {
      PyObject* value = runtime::argument_to_python(stack[i], *schema_args[i].real_type());  // ScalarType, not its int
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
    auto take = [&](PyObject* item) { return runtime::tensor_or_none_from_python(item, outputs.emplace_back()); };
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

}  // namespace

std::unique_ptr<graph::OpOracle> make_meta_oracle() { return std::make_unique<MetaOracle>(); }

passes::CudnnBatchNorm cudnn_batch_norm_here() {
  passes::CudnnBatchNorm cudnn;
  const auto& hooks = at::detail::getCUDAHooks();
  cudnn.available = hooks.compiledWithCuDNN() && at::globalContext().userEnabledCuDNN();
  if (cudnn.available) cudnn.min_epsilon = hooks.batchnormMinEpsilonCuDNN();
  return cudnn;
}

}  // namespace kiln::compile
