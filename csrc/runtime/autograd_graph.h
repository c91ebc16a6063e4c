#pragma once
// The autograd bridge: a captured graph that needs grad, compiled ahead of time as a forward graph and a
// backward graph (compile/split_for_autodiff.h) joined by ONE autograd node, so loss.backward() runs
// the compiled backward (fused kernels) instead of replaying eager autograd op by op. This file only runs the two
// compiled halves: what they are and how their inputs and outputs stand to the captured graph's comes from compile/.
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "graph/graph.h"
#include "runtime/compiled_graph.h"

namespace kiln::runtime {

struct KilnGraphSummary;  // runtime/kernel_graph.h
class DoubleBackwardReplay;  // runtime/double_backward.h

/// A CompiledGraph whose run() returns outputs with one kiln autograd node as their grad_fn when grad
/// mode is on and some input requires grad (otherwise it runs the forward alone). The node's backward
/// runs under create_graph=True by replaying the captured graph (double_backward.h), where that computes what the
/// forward computed; elsewhere it raises kiln.errors.KilnError saying why.
class AutogradGraph : public CompiledGraph {
 public:
  virtual const CompiledGraph& forward() const = 0;
  virtual const CompiledGraph& backward() const = 0;
  /// Inputs the forward updates in place (buffer updates written back after it runs).
  virtual std::vector<int32_t> updated_inputs() const { return {}; }
  /// Filled by kiln_graph_summary() on first use (both halves' kernels, prefixed forward:/backward:).
  mutable std::shared_ptr<KilnGraphSummary> summary_cache;
};

/// What the autograd node needs to know of the two compiled halves, as plain data (compile/ takes it from
/// autodiff::JointGraphs, whose fields these mirror).
struct AutogradSignature {
  size_t num_inputs = 0;   // captured inputs: the forward's inputs, each one gradient of the node's backward
  size_t num_outputs = 0;  // computed captured outputs: the forward's first outputs
  /// Per captured output: -1 for the computed outputs, which follow in order; else the captured input it is, or
  /// whose views view_replays[i] makes of it (eager's view: storage, version counter, autograd history). Empty when
  /// every output is computed.
  std::vector<int32_t> output_inputs;
  std::vector<bool> output_differentiable;  // per computed output: floating and requires grad
  /// After the forward runs, captured input updated_inputs[i] receives forward output num_outputs + i.
  std::vector<int32_t> updated_inputs;
  /// Per saved value (the forward's outputs after the updates, and the backward's inputs after the gradients): the
  /// captured input it is, or -1 when it is the forward's next output.
  std::vector<int32_t> saved_from_input;
  std::vector<int32_t> grad_inputs;  // backward output i is the gradient of captured input grad_inputs[i]
  /// The metas the compiled backward was built for: of its inputs (one gradient per differentiable output, then the
  /// saved values), to which it conforms what arrives, and of its outputs (the gradients).
  std::vector<graph::TensorMeta> backward_inputs;
  std::vector<graph::TensorMeta> backward_outputs;
  /// reaches[i][j]: backward output i depends on the gradient of differentiable output j (backward input j).
  std::vector<std::vector<bool>> reaches;
};

/// The backward compiled again for calls where some differentiable outputs get no gradient (absent[j]: the j-th one
/// gets none), taking only the gradients that come, then the saved values; null where it cannot be
/// (passes/drop_absent_gradients.h). Called with the GIL held, from a forward.
using CompileBackwardWithout = std::function<std::shared_ptr<CompiledGraph>(const std::vector<bool>& absent)>;

/// Joins the compiled `forward` and `backward` halves (both run with grad off) behind one autograd node, as
/// `signature` describes them; `view_replays` has one entry per signature.output_inputs entry (null where the output
/// is the input itself).
///
/// Gradients that do not come. A backward where some output got none fills that gradient with zeros (the backward was
/// built for all of them) and notes which were missing; the next forward then compiles, with `compile_without`, the
/// backward for that pattern, which later backwards with the same pattern run (at most kMaxBackwardVariants patterns
/// per node). The compile runs in a forward, where kiln's compiles always run, never on the engine's backward threads.
///
/// Double backward. `replay` (the captured graph as eager runs it) is what a backward under create_graph=True replays
/// and differentiates; without one, or where it would not compute what the forward did, such a backward raises.
std::shared_ptr<AutogradGraph> make_autograd_graph(AutogradSignature signature, std::shared_ptr<CompiledGraph> forward,
                                                   std::shared_ptr<CompiledGraph> backward,
                                                   std::vector<std::shared_ptr<CompiledGraph>> view_replays,
                                                   CompileBackwardWithout compile_without = {},
                                                   std::shared_ptr<DoubleBackwardReplay> replay = nullptr);
constexpr size_t kMaxBackwardVariants = 4;

/// How many compiled backward halves have run in this process (every kiln autograd node's backward counts once): lets
/// a test see how far a backward had gone when something else happened (a DDP bucket's all-reduce launched).
std::atomic<int64_t>& autograd_backward_runs();

}  // namespace kiln::runtime
