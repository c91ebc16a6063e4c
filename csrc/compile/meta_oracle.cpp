// The OpOracle over the running torch (meta_oracle.h): kiln's shape rules at concrete sizes first, then torch's meta
// kernels through runtime/'s prepared dispatcher calls on meta tensors.
#include "compile/meta_oracle.h"

#include <ATen/Context.h>
#include <c10/core/DefaultDtype.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/empty_strided.h>

#include <optional>
#include <string>

#include "common/error.h"
#include "graph/shape_rules.h"
#include "runtime/node_call.h"

namespace kiln::compile {

namespace {

at::TensorOptions options_of(const graph::TensorMeta& meta, c10::Device device) {
  return at::TensorOptions().dtype(static_cast<at::ScalarType>(meta.dtype)).device(device);
}

at::Tensor meta_tensor(const graph::TensorMeta& meta) {
  at::Tensor t = at::empty_strided(meta.sizes, meta.strides, options_of(meta, c10::Device(c10::kMeta)));
  if (meta.storage_offset != 0) t = t.as_strided(meta.sizes, meta.strides, meta.storage_offset);
  return t;
}

// Gives each emitted backward op's results the metas of kiln's shape rules at concrete sizes, else runs it on meta
// tensors shaped like its arguments: PyTorch's meta kernels give the results' sizes, strides and dtype.
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
    const bool by_rules = !prepared.returns_list &&
                          meta_outputs_from_rules(node.qualified_name(), node.args, meta_of(g), outputs_) &&
                          outputs_.size() == node.outputs.size();
    if (by_rules) {
      for (size_t i = 0; i < outputs_.size(); ++i) values_[node.outputs[i]] = std::move(outputs_[i]);
    } else {
      runtime::call_node(prepared, g, values_, values_);
    }
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
  static std::function<const graph::TensorMeta&(graph::ValueId)> meta_of(const graph::Graph& g) {
    return [&g](graph::ValueId id) -> const graph::TensorMeta& { return g.values[id].meta; };
  }

  std::vector<at::Tensor> values_;  // meta tensors by ValueId of the graph last asked about
  std::vector<at::Tensor> outputs_;  // a rule's answer
};

}  // namespace

std::unique_ptr<graph::OpOracle> make_meta_oracle() { return std::make_unique<MetaOracle>(); }

bool meta_outputs_from_rules(const std::string& op, const std::vector<graph::ArgValue>& args,
                             const std::function<const graph::TensorMeta&(graph::ValueId)>& meta_of,
                             std::vector<at::Tensor>& outputs) {
  // The rules give a factory without a dtype float32 (graph/shape_rules_impl.h's kDefaultDtype): another default is
  // torch's to apply.
  if (c10::get_default_dtype() != caffe2::TypeMeta::Make<float>()) return false;
  std::optional<std::vector<std::optional<graph::TensorMeta>>> metas =
      graph::shape::infer_concrete_metas(op, args, meta_of);
  if (!metas) return false;
  outputs.clear();
  for (const std::optional<graph::TensorMeta>& meta : *metas) outputs.push_back(meta ? meta_tensor(*meta) : at::Tensor());
  return true;
}

passes::CudnnBatchNorm cudnn_batch_norm_here() {
  passes::CudnnBatchNorm cudnn;
  const auto& hooks = at::detail::getCUDAHooks();
  cudnn.available = hooks.compiledWithCuDNN() && at::globalContext().userEnabledCuDNN();
  if (cudnn.available) cudnn.min_epsilon = hooks.batchnormMinEpsilonCuDNN();
  return cudnn;
}

}  // namespace kiln::compile
