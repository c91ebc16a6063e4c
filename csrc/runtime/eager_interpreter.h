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
/// True when `g` switches grad mode (kiln::set_grad_enabled nodes from traced grad-mode blocks), some value
/// requires grad, and the switches are more than no_grad blocks compiled autograd reproduces: autograd must then
/// record exactly the ops eager records under each mode, which only the op-by-op interpreter does. A graph entered
/// with grad enabled whose switches each flip the mode and end it enabled, with no in-place op while it is off, is
/// differentiated as recorded: the values computed with grad off already have requires_grad false in their metas,
/// so no gradient flows through them, as in eager (compile/pipeline.cpp then drops the switches).
bool needs_eager_for_grad_mode(const graph::Graph& g);

/// True when some op of `g` is outside ATen's and kiln's namespaces: a custom op (torch.library) whose kernel or
/// autograd formula may be Python, which the frame hook must not compile while the graph runs
/// (CompiledGraph::reenters_python).
bool calls_custom_ops(const graph::Graph& g);

std::shared_ptr<CompiledGraph> make_eager_interpreter(std::shared_ptr<const graph::Graph> g,
                                                      std::vector<at::Tensor> constants);

}  // namespace kiln::runtime
