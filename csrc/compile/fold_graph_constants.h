#pragma once
// Constant folding on real tensors: passes/fold_constants.h plans which values of a graph depend on no input;
// this runs their nodes once, at compile time, and returns the graph that reads the results as constants.
#include <memory>
#include <string>
#include <vector>

#include "graph/graph.h"
#include "runtime/kernel_graph.h"

namespace kiln::compile {

/// Folds the graph's constant work; `folded` receives one line per folded value ("%7 = f32[8, 8] from
/// aten::triu.default"). Returns `g` itself when nothing folds, or when evaluating the nodes fails (logged under
/// `fallbacks`: the graph then computes them per call as before). Needs the GIL.
std::shared_ptr<const graph::Graph> fold_graph_constants(std::shared_ptr<const graph::Graph> g, const runtime::ConstantsOf& constants_of,
                                                         std::vector<std::string>& folded);

}  // namespace kiln::compile
