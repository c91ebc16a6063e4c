#pragma once
#include "graph/graph.h"

namespace kiln::passes {

/// The graph passes the "kiln" backend runs before scheduling, in order, with the graph verifier after
/// each one when KILN_VERIFY=1 (and always on the input). Needs: a graph as the tracer made it.
/// Guarantees: same outputs for the same inputs; fewer or equal nodes.
void run_graph_passes(graph::Graph& g);

/// True when KILN_VERIFY is set to something other than "" or "0".
bool verify_enabled();

}  // namespace kiln::passes
