#pragma once
// The "eager" backend: replays a graph op by op through the c10 dispatcher.
#include <memory>
#include <vector>

#include "graph/graph.h"
#include "runtime/compiled_graph.h"

namespace kiln::runtime {

/// Prepares `g` for replay: looks up every op's OperatorHandle, converts constant arguments to IValues
/// once and plans when each intermediate is freed. `constants[id]` is the real tensor of constant value
/// `id` (undefined for other values). Unknown ops or argument lists that do not match the schema raise
/// an error naming the node.
std::shared_ptr<CompiledGraph> make_eager_interpreter(std::shared_ptr<const graph::Graph> g,
                                                      std::vector<at::Tensor> constants);

}  // namespace kiln::runtime
