// run_pass and the generic clean-up passes (pipeline.h): each step commented with why it sits where it does.
#include "passes/pipeline.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "common/log.h"
#include "common/progress.h"
#include "passes/eliminate_common_subexpressions.h"
#include "passes/fuse_recomputation.h"
#include "passes/remove_dead_nodes.h"
#include "passes/simplify_algebra.h"

namespace kiln::passes {

bool verify_enabled() {
  const char* v = std::getenv("KILN_VERIFY");
  return v && *v && std::string(v) != "0";
}

bool run_pass(const char* name, graph::Graph& g, const std::function<bool(graph::Graph&)>& pass) {
  const bool changed = pass(g);
  progress::tick();
  if (verify_enabled()) {
    try {
      g.verify();
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string("graph verifier failed after pass ") + name + ": " + e.what());
    }
  }
  if (changed) KILN_LOG(passes) << "after " << name << ":\n" << g.to_string();
  else KILN_LOG(passes) << "after " << name << ": no change";
  return changed;
}

void run_graph_passes(graph::Graph& g) {
  if (verify_enabled()) {
    try {
      g.verify();
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string("graph verifier failed on the input of the graph passes: ") + e.what());
    }
  }
  // Identities first: their readers then read the operand, which CSE may merge further.
  run_pass("simplify_algebra", g, [](graph::Graph& graph) { return simplify_algebra(graph) > 0; });
  // CSE next: merged duplicates become dead, and the dead-node sweep below collects them.
  run_pass("eliminate_common_subexpressions", g, [](graph::Graph& graph) {
    eliminate_common_subexpressions(graph);
    return true;  // it reports nothing: the graph is printed whether or not it merged
  });
  run_pass("remove_dead_nodes", g, [](graph::Graph& graph) {
    const size_t before = graph.nodes.size();
    remove_dead_nodes(graph);
    return graph.nodes.size() != before;
  });
  // Last: it only reorders the nodes left.
  run_pass("fuse_recomputation", g, [](graph::Graph& graph) {
    fuse_recomputation(graph);
    return true;
  });
}

}  // namespace kiln::passes
