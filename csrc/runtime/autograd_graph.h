#pragma once
// The autograd bridge: a captured graph that needs grad, compiled ahead of time as a forward graph and a
// backward graph (autodiff/build_joint_graphs.h) joined by ONE autograd node, so loss.backward() runs
// the compiled backward (fused kernels) instead of replaying eager autograd op by op.
#include <functional>
#include <memory>

#include "graph/graph.h"
#include "runtime/compiled_graph.h"

namespace kiln::runtime {

struct KilnGraphSummary;  // runtime/kernel_graph.h

using CompileGradFreeGraph = std::function<std::shared_ptr<CompiledGraph>(std::shared_ptr<const graph::Graph>)>;

/// A CompiledGraph whose run() returns outputs with one kiln autograd node as their grad_fn when grad
/// mode is on and some input requires grad (otherwise it runs the forward alone). The node's backward
/// raises kiln.errors.KilnError under create_graph=True (double backward is not supported).
class AutogradGraph : public CompiledGraph {
 public:
  virtual const CompiledGraph& forward() const = 0;
  virtual const CompiledGraph& backward() const = 0;
  /// Inputs the forward updates in place (buffer updates written back after it runs).
  virtual std::vector<int32_t> updated_inputs() const { return {}; }
  /// Filled by kiln_graph_summary() on first use (both halves' kernels, prefixed forward:/backward:).
  mutable std::shared_ptr<KilnGraphSummary> summary_cache;
};

/// Differentiates `g` and compiles both halves with `compile_part` (called with graphs that need no grad).
/// Throws kiln::Error (kind Unsupported for graphs autodiff does not cover) so the caller can keep the
/// eager interpreter. Call with the GIL held.
std::shared_ptr<AutogradGraph> compile_autograd_graph(std::shared_ptr<const graph::Graph> g,
                                                      const CompileGradFreeGraph& compile_part);

/// `g` with its training-mode batch norms on cuDNN where eager would run them there
/// (passes/use_cudnn_batch_norm.h), or `g` itself when none qualifies: for the eager interpreter, whose replay
/// then records eager's own autograd nodes.
std::shared_ptr<const graph::Graph> with_cudnn_batch_norm(std::shared_ptr<const graph::Graph> g);

}  // namespace kiln::runtime
