#pragma once
// Constant folding over the ATen graph: work that reads no graph input (a mask built from torch.full and triu,
// a table built from arange, a reduction of a tensor made inside the function) is computed once, when the graph
// is compiled, and read as a constant afterwards. Torch-free: the pass plans and rewrites; the caller evaluates
// the planned nodes on real tensors (runtime/kernel_graph.cpp) and hands the results back.
#include <cstdint>
#include <string>
#include <vector>

#include "graph/graph.h"

namespace kiln::passes {

struct ConstantFolding {
  std::vector<graph::ValueId> values;   // the values that become constants, in definition order
  std::vector<graph::NodeIndex> nodes;  // the nodes that compute them, in graph order
  bool empty() const { return values.empty(); }
};

/// The largest value the pipeline folds (compile/fold_graph_constants.cpp): 16 MiB. The C++ loader of exported
/// programs (csrc/export) asks the same plan whether a saved graph was compiled as it is.
constexpr int64_t kMaxFoldedBytes = 16 << 20;

/// Plans which values to fold. A node folds when it is pure and deterministic (passes/remove_dead_nodes.h, plus
/// matmuls and cumulative sums), every tensor it reads is a constant or a folded value, its results need no grad,
/// and share no storage with a graph output (eager returns a new tensor per call, which the caller may write) or
/// with a tensor some node writes in place. Of the foldable values the graph's other nodes read, views, fills (full, zeros, ones, their
/// `_like` forms) and allocations are left as nodes: fusion computes them inside the kernels that read them, for
/// free; their foldable operands are folded instead. A value larger than `max_bytes` is left as a node too.
ConstantFolding plan_constant_folding(const graph::Graph& g, int64_t max_bytes);

/// The plan that computes value `v` alone, when it depends on no graph input (whatever plan_constant_folding would
/// leave as a node, a fill included); empty otherwise, and for a value that already is a constant.
ConstantFolding plan_value_folding(const graph::Graph& g, graph::ValueId v);

/// Makes each planned value a constant holding `tensors[i]` and removes the nodes only they needed; value ids are
/// renumbered (remove_dead_nodes.h: renumber_producers), and the old-to-new map is returned, so that a caller which
/// keeps constant tensors apart from the graph (the C++ loader, csrc/export) finds each constant's new id. The caller
/// takes the references (PyObjectRef::steal), so that this pass links no CPython symbol.
std::vector<graph::ValueId> fold_constants(graph::Graph& g, const ConstantFolding& plan,
                                           std::vector<graph::PyObjectRef> tensors);

}  // namespace kiln::passes
