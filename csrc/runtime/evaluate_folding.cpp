// Folded values computed on real tensors (evaluate_folding.h).
#include "runtime/evaluate_folding.h"

#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <stdexcept>

#include "runtime/node_call.h"

namespace kiln::runtime {

namespace {

bool matches_meta(const at::Tensor& t, const graph::TensorMeta& meta) {
  return t.defined() && t.sizes().vec() == meta.sizes && t.strides().vec() == meta.strides &&
         t.storage_offset() == meta.storage_offset &&
         static_cast<int8_t>(t.scalar_type()) == static_cast<int8_t>(meta.dtype) &&
         static_cast<int8_t>(t.device().type()) == static_cast<int8_t>(meta.device.type);
}

}  // namespace

std::vector<at::Tensor> evaluate_folded_values(const graph::Graph& g, const passes::ConstantFolding& plan,
                                               std::vector<at::Tensor> constants) {
  at::AutoGradMode no_grad(false);
  constants.resize(g.values.size());
  std::vector<at::Tensor> env(g.values.size());
  for (graph::NodeIndex i : plan.nodes) call_node(prepare_node(g, g.nodes[i], constants), g, constants, env);
  std::vector<at::Tensor> results;
  for (graph::ValueId v : plan.values) {
    if (!matches_meta(env[v], g.values[v].meta))
      throw std::runtime_error("a folded value came out with another layout than its recorded " +
                               graph::meta_to_string(g.values[v].meta));
    results.push_back(env[v]);
  }
  // A later call may run on another stream: the constants are finished before any kernel can read them.
  for (const at::Tensor& t : results)
    if (t.is_cuda()) {
      const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
      cuda->synchronizeStream(cuda->getStream(t.device()));
      break;
    }
  return results;
}

}  // namespace kiln::runtime
