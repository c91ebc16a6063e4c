#pragma once
/// Groups a graph's nodes into fused kernels and extern calls (fusion/loop_ir.h).
///
/// Needs: a verified graph with no in-place or out= nodes (callers keep those graphs on the eager
/// interpreter). Guarantees: running the steps in order computes every graph output; a value read by an
/// extern call, returned by the graph, or read by a later kernel is materialised; every other
/// intermediate exists only inside one kernel. Ops outside decomp/'s table are extern calls.
#include "fusion/loop_ir.h"
#include "graph/graph.h"

namespace kiln::fusion {

Schedule schedule_kernels(const graph::Graph& g);

}  // namespace kiln::fusion
