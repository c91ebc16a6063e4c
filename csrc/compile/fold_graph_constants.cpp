// Constant folding on real tensors (compile/fold_graph_constants.h).
#include "compile/fold_graph_constants.h"

#include <Python.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <sstream>

#include "common/log.h"
#include "passes/fold_constants.h"
#include "passes/pipeline.h"
#include "runtime/node_call.h"
#include "runtime/python_bridge.h"

namespace kiln::compile {

namespace {

bool matches_meta(const at::Tensor& t, const graph::TensorMeta& meta) {
  return t.defined() && t.sizes().vec() == meta.sizes && t.strides().vec() == meta.strides &&
         t.storage_offset() == meta.storage_offset && static_cast<int8_t>(t.scalar_type()) == static_cast<int8_t>(meta.dtype) &&
         static_cast<int8_t>(t.device().type()) == static_cast<int8_t>(meta.device.type);
}

}  // namespace

std::shared_ptr<const graph::Graph> fold_graph_constants(std::shared_ptr<const graph::Graph> g, const runtime::ConstantsOf& constants_of,
                                                         std::vector<std::string>& folded) {
  const passes::ConstantFolding plan = passes::plan_constant_folding(*g, passes::kMaxFoldedBytes);
  if (plan.empty()) return g;
  std::vector<at::Tensor> results;
  try {
    at::AutoGradMode no_grad(false);
    std::vector<at::Tensor> constants = constants_of(*g);
    constants.resize(g->values.size());
    std::vector<at::Tensor> env(g->values.size());
    for (graph::NodeIndex i : plan.nodes) runtime::call_node(runtime::prepare_node(*g, g->nodes[i], constants), *g, constants, env);
    for (graph::ValueId v : plan.values) {
      if (!matches_meta(env[v], g->values[v].meta))
        throw std::runtime_error("a folded value came out with another layout than its recorded " +
                                 graph::meta_to_string(g->values[v].meta));
      results.push_back(env[v]);
    }
    // A later call may run on another stream: the constants are finished before any kernel can read them.
    for (const at::Tensor& t : results)
      if (t.is_cuda()) {
        const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
        cuda->synchronizeStream(cuda->getStream(t.device()));
        break;
      }
  } catch (const std::exception& e) {
    KILN_LOG(fallbacks) << "kiln backend: not folding constants (the graph computes them per call): " << e.what();
    return g;
  }
  std::vector<std::string> lines;
  for (graph::ValueId v : plan.values) {
    std::ostringstream line;
    line << '%' << v << " = " << graph::meta_to_string(g->values[v].meta) << " from "
         << g->nodes[g->values[v].producer].qualified_name();
    lines.push_back(line.str());
  }
  std::vector<graph::PyObjectRef> tensors;
  for (const at::Tensor& t : results) tensors.push_back(graph::PyObjectRef::steal(runtime::tensor_to_python(t)));
  auto rewritten = std::make_shared<graph::Graph>(*g);
  passes::fold_constants(*rewritten, plan, std::move(tensors));
  if (passes::verify_enabled()) rewritten->verify();
  KILN_LOG(perf) << "kiln backend: " << lines.size() << " values folded to constants";
  folded = std::move(lines);
  return rewritten;
}

}  // namespace kiln::compile
