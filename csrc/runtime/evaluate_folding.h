#pragma once
// The real-tensor half of constant folding (passes/fold_constants.h plans it and rewrites the graph): the planned
// nodes run once through the dispatcher. Shared by the pipeline (compile/fold_graph_constants.cpp) and the C++ loader
// of exported programs (csrc/export), which must fold exactly as the pipeline did to use the compiled code it saved.
#include <ATen/core/Tensor.h>

#include <vector>

#include "graph/graph.h"
#include "passes/fold_constants.h"

namespace kiln::runtime {

/// The values `plan` folds, in plan order, computed with grad off from `constants` (indexed by ValueId, the real
/// tensors of the graph's constants). Throws when a node fails or a result is laid out otherwise than its recorded
/// meta (the graph must then keep computing it per call). CUDA results are finished before this returns.
std::vector<at::Tensor> evaluate_folded_values(const graph::Graph& g, const passes::ConstantFolding& plan,
                                               std::vector<at::Tensor> constants);

}  // namespace kiln::runtime
