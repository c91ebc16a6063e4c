#pragma once
// A sum over the rows of a flattened view, `x.view(B * N, C).sum(0)` (every F.linear bias gradient on a 3-d
// input), taken as a sum over the unflattened value's leading dims instead: x's own shape then matches the
// kernel that computes x, so fusion folds the sum into it (the gradient is summed while it is computed and
// stored), rather than reading x back in a kernel of its own. Torch-free.
#include "graph/graph.h"

namespace kiln::passes {

/// Rewrites `aten::sum.dim_IntList(view(x, [R, C...]), [0], keepdim, dtype=None)`, and
/// `aten::sum.dim_IntList(x, [0, ..., m-1], keepdim, dtype=None)` where it takes two stages, where x is
/// [d0, ..., dm-1, C...] with d0 * ... * dm-1 == R and m >= 2, into sums over x itself, where x is computed by
/// decomposed ops (fusion can put the sum in their kernel) none of which is a reduction (whose kernel reduces
/// other dims already). For float32/float64 with
/// d0 >= 2 and at least 16 rows per d0 it takes two stages, `x.sum([1..m-1]).sum(0, keepdim)`: the first has
/// d0 times more outputs to spread over the device, and its rows are d0 times shorter. Otherwise one sum over
/// dims [0..m-1] (half types keep one rounding, as eager's sum does), viewed back to the node's shape. The
/// node's output value is kept, so its consumers are untouched. Returns true if it changed the graph.
bool stage_row_sums(graph::Graph& g);

}  // namespace kiln::passes
