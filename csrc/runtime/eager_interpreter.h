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
/// True when `g` switches grad mode (kiln::set_grad_enabled nodes from traced grad-mode blocks) and some
/// value requires grad: autograd must then record exactly the ops eager records under each mode, which
/// only the op-by-op interpreter does (fused kernels and compiled autograd assume one mode per graph).
bool needs_eager_for_grad_mode(const graph::Graph& g);

std::shared_ptr<CompiledGraph> make_eager_interpreter(std::shared_ptr<const graph::Graph> g,
                                                      std::vector<at::Tensor> constants);

}  // namespace kiln::runtime
