#pragma once
#include "graph/graph.h"

namespace kiln::passes {

/// Merges pure nodes (passes::is_pure_node) that call the same op overload with the same arguments: later
/// readers use the first node's outputs. Needs: a verified graph. Guarantees: the duplicates are left
/// without readers (remove_dead_nodes drops them); effectful nodes are never merged.
void eliminate_common_subexpressions(graph::Graph& g);

}  // namespace kiln::passes
