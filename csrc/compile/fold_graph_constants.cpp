// Constant folding on real tensors (compile/fold_graph_constants.h).
#include "compile/fold_graph_constants.h"

#include <Python.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <sstream>

#include "common/log.h"
#include "graph/op_facts.h"
#include "passes/fold_constants.h"
#include "passes/pipeline.h"
#include "passes/remove_dead_nodes.h"
#include "runtime/evaluate_folding.h"
#include "runtime/node_call.h"
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

namespace {

// The value of `v` when it reads no graph input (a constant, or made by pure nodes from constants alone: a mask
// built with torch.ones, which constant folding leaves to fusion), computed here; undefined otherwise.
at::Tensor compute_if_constant(const graph::Graph& g, graph::ValueId v, std::vector<at::Tensor>& constants) {
  std::vector<graph::NodeIndex> needed;
  std::vector<bool> seen(g.values.size(), false);
  std::vector<graph::ValueId> work = {v};
  while (!work.empty()) {
    const graph::ValueId u = work.back();
    work.pop_back();
    if (seen[u]) continue;
    seen[u] = true;
    const graph::Value& value = g.values[u];
    if (value.is_constant) continue;
    if (value.producer < 0) return {};  // a graph input
    const graph::Node& n = g.nodes[value.producer];
    if (n.mutates_args || !(passes::is_pure_node(g, n) || graph::op_facts(n.qualified_name()).deterministic)) return {};
    needed.push_back(value.producer);
    for (const graph::ArgValue& arg : n.args) graph::for_each_tensor(arg, [&](graph::ValueId w) { work.push_back(w); });
  }
  std::sort(needed.begin(), needed.end());
  needed.erase(std::unique(needed.begin(), needed.end()), needed.end());
  std::vector<at::Tensor> env(g.values.size());
  for (graph::ValueId c = 0; c < g.values.size(); ++c)
    if (g.values[c].is_constant && c < constants.size()) env[c] = constants[c];
  for (graph::NodeIndex i : needed) runtime::call_node(runtime::prepare_node(g, g.nodes[i], constants), g, constants, env);
  return env[v];
}

}  // namespace

std::shared_ptr<const graph::Graph> drop_attention_masks_that_mask_nothing(std::shared_ptr<const graph::Graph> g,
                                                                            const runtime::ConstantsOf& constants_of) {
  std::vector<at::Tensor> constants;
  std::vector<size_t> unmasked;
  try {
    at::AutoGradMode no_grad(false);
    for (size_t n = 0; n < g->nodes.size(); ++n) {
      const graph::Node& node = g->nodes[n];
      if (node.qualified_name() != "aten::scaled_dot_product_attention.default" || node.args.size() < 4) continue;
      const auto* mask = std::get_if<graph::TensorArg>(&node.args[3]);
      if (!mask) continue;
      if (constants.empty()) {
        constants = constants_of(*g);
        constants.resize(g->values.size());
      }
      const at::Tensor m = compute_if_constant(*g, mask->id, constants);
      if (!m.defined()) continue;
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
