// The pass pipeline: a straight line, each step commented with why it sits where it does.
#include "passes/pipeline.h"

#include <cstdlib>
#include <string>

#include "common/log.h"
#include "passes/eliminate_common_subexpressions.h"
#include "passes/fuse_recomputation.h"
#include "passes/remove_dead_nodes.h"
#include "passes/simplify_algebra.h"

namespace kiln::passes {

bool verify_enabled() {
  const char* v = std::getenv("KILN_VERIFY");
  return v && *v && std::string(v) != "0";
}

void run_graph_passes(graph::Graph& g) {
  const bool verify = verify_enabled();
  auto after = [&](const char* pass) {
    if (!verify) return;
    try {
      g.verify();
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string("graph verifier failed after pass ") + pass + ": " + e.what());
    }
  };
  after("(input)");
  // Identities first: their readers then read the operand, which CSE may merge further.
  simplify_algebra(g);
  after("simplify_algebra");
  // CSE next: merged duplicates become dead, and the dead-node sweep below collects them.
  eliminate_common_subexpressions(g);
  after("eliminate_common_subexpressions");
  remove_dead_nodes(g);
  after("remove_dead_nodes");
  // Last: it only reorders the nodes left.
  fuse_recomputation(g);
  after("fuse_recomputation");
}

}  // namespace kiln::passes
