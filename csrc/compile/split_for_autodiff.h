#pragma once
// The pipeline's autodiff split (pipeline.h): a captured graph that needs grad becomes a forward graph and a
// backward graph (autodiff/build_joint_graphs.h, or the joint graphs kept in the graph cache), each compiled as a
// training half, joined behind one autograd node by runtime/ (runtime/autograd_graph.h).
#include <cstdint>
#include <functional>
#include <memory>

#include "graph/graph.h"
#include "runtime/autograd_graph.h"
#include "runtime/compiled_graph.h"

namespace kiln::compile {

/// Compiles one half of the split: a graph that needs no grad, of which the first `escaping` outputs reach the caller
/// (the forward's computed outputs; every gradient of the backward) and the others stay inside kiln (saved values,
/// buffer updates written back at once).
using CompileHalf =
    std::function<std::shared_ptr<runtime::CompiledGraph>(std::shared_ptr<const graph::Graph>, size_t escaping)>;

/// Needs: `g` needs grad. Builds the joint graphs of `g` (asking the running torch for the backward ops' metas:
/// compile/meta_oracle.h) or reads them from the graph cache, compiles the forward and then the backward with
/// `compile_half`, and returns them joined behind one autograd node, which keeps `compile_half` to compile the backward
/// again for gradients that do not come (runtime/autograd_graph.h): it must own what it captures. Logs the partition and both graphs under
/// `graph`, times under `perf`, and adds to the backend's autograd stats. Throws kiln::Error (kind Unsupported for
/// graphs autodiff does not cover) so the caller can keep the eager interpreter. Call with the GIL held.
/// `replay`: what the node replays for a backward under create_graph=True (runtime/double_backward.h), or null.
std::shared_ptr<runtime::AutogradGraph> split_for_autodiff(std::shared_ptr<const graph::Graph> g,
                                                           CompileHalf compile_half,
                                                           std::shared_ptr<runtime::DoubleBackwardReplay> replay);

}  // namespace kiln::compile
