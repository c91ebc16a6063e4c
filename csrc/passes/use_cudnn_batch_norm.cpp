// Training-mode batch norm as cuDNN's kernel where eager would run it (passes/use_cudnn_batch_norm.h).
#include "passes/use_cudnn_batch_norm.h"

#include <variant>

#include "common/error.h"

namespace kiln::passes {

namespace {

using graph::ArgValue;
using graph::ScalarType;
using graph::tensor_meta;

// Strides equal to `wanted` wherever the size exceeds 1 (ATen's contiguity test ignores the others).
bool strided_as(const graph::TensorMeta& m, const std::vector<int64_t>& wanted) {
  for (size_t d = 0; d < m.sizes.size(); ++d)
    if (m.sizes[d] > 1 && m.strides[d] != wanted[d]) return false;
  return true;
}

// Dense in the layout ATen would suggest for it: the default one, or channels-last for a 4-d tensor.
bool dense_in_suggested_layout(const graph::TensorMeta& m) {
  if (m.storage_offset != 0) return false;
  if (strided_as(m, graph::contiguous_strides(m.sizes))) return true;
  if (m.sizes.size() != 4) return false;
  const int64_t c = m.sizes[1], h = m.sizes[2], w = m.sizes[3];
  return strided_as(m, {c * h * w, 1, w * c, c});
}

bool same_meta(const graph::TensorMeta& a, const graph::TensorMeta& b) {
  return a.sizes == b.sizes && a.dtype == b.dtype && strided_as(a, b.strides);
}

// native_batch_norm(input, weight?, bias?, running_mean?, running_var?, training, momentum, eps): eager's cuDNN
// conditions (ATen's _batch_norm_impl_index) on the recorded metas.
bool cudnn_takes(const graph::Graph& g, const graph::Node& node, const CudnnBatchNorm& cudnn) {
  const std::vector<ArgValue>& a = node.args;
  if (a.size() != 8) return false;
  const graph::TensorMeta* input = tensor_meta(g, a[0]);
  const graph::TensorMeta* weight = tensor_meta(g, a[1]);
  const graph::TensorMeta* bias = tensor_meta(g, a[2]);
  const graph::TensorMeta* mean = tensor_meta(g, a[3]);
  const graph::TensorMeta* var = tensor_meta(g, a[4]);
  const auto* training = std::get_if<bool>(&a[5]);
  const auto* eps = std::get_if<double>(&a[7]);
  if (!input || !weight || !bias || !training || !*training || !eps || (mean == nullptr) != (var == nullptr))
    return false;
  if (input->device.type != graph::DeviceType::CUDA || input->sizes.size() < 3 || input->sizes[0] > 880801)
    return false;
  const bool dtypes = (input->dtype == ScalarType::Float && weight->dtype == ScalarType::Float) ||
                      (input->dtype == ScalarType::Half && weight->dtype == ScalarType::Float);
  if (!dtypes || *eps < cudnn.min_epsilon || !dense_in_suggested_layout(*input)) return false;
  for (const graph::TensorMeta* vector : {weight, bias, mean, var})
    if (vector && (vector->sizes.size() != 1 || vector->strides[0] != 1 || vector->storage_offset != 0 ||
                   vector->dtype != weight->dtype))
      return false;
  return true;
}

}  // namespace

bool is_opaque_workspace(const graph::TensorMeta& meta) {
  return meta.dtype == ScalarType::Byte && meta.sizes.size() == 1 && meta.sizes[0] == 0;
}

bool use_cudnn_batch_norm(graph::Graph& g, graph::OpOracle& oracle, const CudnnBatchNorm& cudnn) {
  if (!cudnn.available) return false;
  bool changed = false;
  for (size_t n = 0; n < g.nodes.size(); ++n) {
    graph::Node& node = g.nodes[n];
    if (node.qualified_name() != "aten::native_batch_norm.default" || node.outputs.size() != 3 ||
        !cudnn_takes(g, node, cudnn))
      continue;
    graph::Node lowered;
    // cudnn_batch_norm(input, weight, bias?, running_mean?, running_var?, training, exponential_average_factor, epsilon)
    lowered.op = "aten::cudnn_batch_norm";
    lowered.overload = "default";
    lowered.args = node.args;
    std::vector<graph::TensorMeta> metas = oracle.complete_node(g, lowered);
    if (metas.size() != 4) continue;
    bool agrees = true;  // the recorded results, as cuDNN's meta kernel lays them out
    for (size_t r = 0; r < 3; ++r) agrees = agrees && same_meta(metas[r], g.value(node.outputs[r]).meta);
    if (!agrees || !is_opaque_workspace(metas[3])) continue;
    lowered.outputs = node.outputs;
    graph::Value workspace;
    workspace.id = static_cast<graph::ValueId>(g.values.size());
    workspace.meta = metas[3];
    workspace.meta.requires_grad = false;
    workspace.producer = static_cast<graph::NodeIndex>(n);
    lowered.outputs.push_back(workspace.id);
    g.values.push_back(std::move(workspace));
    g.nodes[n] = std::move(lowered);
    changed = true;
  }
  return changed;
}

}  // namespace kiln::passes
