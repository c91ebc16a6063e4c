#pragma once
// Running graph passes: every pass goes through run_pass, which names it, runs the graph verifier after it
// (KILN_VERIFY=1) and prints the graph it leaves (KILN_LOGS=passes), so a pipeline is a straight list of
// named steps (compile/pipeline.cpp). run_graph_passes is the generic clean-up run last before scheduling.
#include <functional>

#include "graph/graph.h"

namespace kiln::passes {

/// Runs `pass` on `g` (it returns whether it changed anything, or true when it cannot tell). Then, when KILN_VERIFY=1, verifies the graph and
/// throws naming the pass if it is broken; when KILN_LOGS=passes, prints "after <name>" and the graph (or that it
/// did not change). Returns what the pass returned.
bool run_pass(const char* name, graph::Graph& g, const std::function<bool(graph::Graph&)>& pass);

/// The generic passes run before scheduling, in order: simplify_algebra, eliminate_common_subexpressions,
/// remove_dead_nodes, fuse_recomputation. Needs: a graph as the tracer made it (the verifier runs on it first
/// under KILN_VERIFY=1). Guarantees: same outputs for the same inputs; fewer or equal nodes.
void run_graph_passes(graph::Graph& g);

/// True when KILN_VERIFY is set to something other than "" or "0".
bool verify_enabled();

}  // namespace kiln::passes
