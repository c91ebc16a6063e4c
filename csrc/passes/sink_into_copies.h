#pragma once
// A pointwise op whose only use is a permuting copy computes in the copy's shape instead:
// `clone(views(add(x, b)))` becomes `clone(add(as_strided(x), as_strided(b)))`, each operand read through the
// same views. Fusion then gives the add and the copy one kernel that stores only the copy (eager, and until
// now kiln, write the sum, then read it back to copy it). nn.MultiheadAttention's general path on CUDA adds the
// in-projection bias, then splits q, k and v with `unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2)
// .squeeze(-2).contiguous()`: two passes over [B * S, 3 E] where one is needed. Torch-free.
#include "graph/graph.h"

namespace kiln::passes {

/// Rewrites `aten::clone` of a chain of affine views (each value used once, none a graph output) of the
/// dense, contiguous result of `aten::add/sub/mul/div.Tensor` (used once) into the same op over its
/// operands viewed alike (`aten::as_strided`), when every view dim walks one dim of that result. Returns true
/// if it changed the graph; the op and the views are left dead for remove_dead_nodes.
bool sink_pointwise_into_copies(graph::Graph& g);

}  // namespace kiln::passes
