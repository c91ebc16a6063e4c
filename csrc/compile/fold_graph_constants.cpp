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

std::shared_ptr<const graph::Graph> drop_attention_masks_that_mask_nothing(std::shared_ptr<const graph::Graph> g,
                                                                            const runtime::ConstantsOf& constants_of) {
  std::vector<at::Tensor> constants;
  std::vector<size_t> unmasked;
  try {
    for (size_t n = 0; n < g->nodes.size(); ++n) {
      const graph::Node& node = g->nodes[n];
      if (node.qualified_name() != "aten::scaled_dot_product_attention.default" || node.args.size() < 4) continue;
      const auto* mask = std::get_if<graph::TensorArg>(&node.args[3]);
      if (!mask) continue;
      if (constants.empty()) {
        constants = constants_of(*g);
        constants.resize(g->values.size());
      }
      // The mask's value when it reads no graph input: a constant, or made from constants (torch.ones).
      at::Tensor m = g->values[mask->id].is_constant ? constants[mask->id] : at::Tensor();
      if (!m.defined()) {
        const passes::ConstantFolding plan = passes::plan_value_folding(*g, mask->id);
        if (plan.empty()) continue;
        m = runtime::evaluate_folded_values(*g, plan, constants).at(0);
      }
      const bool keeps_all = m.scalar_type() == at::kBool ? m.all().item<bool>()
                                                          : m.is_floating_point() && m.eq(0).all().item<bool>();
      if (keeps_all) unmasked.push_back(n);
    }
  } catch (const std::exception& e) {
    KILN_LOG(fallbacks) << "kiln backend: not reading attention masks: " << e.what();
    return g;
  }
  if (unmasked.empty()) return g;
  auto rewritten = std::make_shared<graph::Graph>(*g);
  for (size_t n : unmasked) rewritten->nodes[n].args[3] = graph::NoneArg{};
  if (passes::verify_enabled()) rewritten->verify();
  KILN_LOG(perf) << "kiln backend: " << unmasked.size() << " attention masks that mask nothing dropped";
  return rewritten;
}

}  // namespace kiln::compile
