// Constant folding on real tensors (compile/fold_graph_constants.h).
#include "compile/fold_graph_constants.h"

#include <Python.h>

#include <sstream>

#include "common/log.h"
#include "passes/fold_constants.h"
#include "passes/pipeline.h"
#include "runtime/evaluate_folding.h"
#include "runtime/python_bridge.h"

namespace kiln::compile {

std::shared_ptr<const graph::Graph> fold_graph_constants(std::shared_ptr<const graph::Graph> g, const runtime::ConstantsOf& constants_of,
                                                         std::vector<std::string>& folded) {
  const passes::ConstantFolding plan = passes::plan_constant_folding(*g, passes::kMaxFoldedBytes);
  if (plan.empty()) return g;
  std::vector<at::Tensor> results;
  try {
    results = runtime::evaluate_folded_values(*g, plan, constants_of(*g));
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
