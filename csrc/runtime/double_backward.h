#pragma once
// Double backward through a compiled training graph (runtime/autograd_graph.h). The compiled backward is a graph of
// kernels with no autograd history of its own, so a backward under create_graph=True (a gradient penalty, a
// physics-informed loss of du/dx, MAML's inner step) cannot run it. It instead replays the captured graph op by op
// on the forward's inputs, with autograd recording as eager records, and differentiates the replay with
// create_graph=True: the gradients it returns carry eager's history back to those inputs, and a second backward
// through them runs eager's double-backward formulas. Only such backwards pay for this; the forward keeps a
// reference to each input and its version.
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "graph/graph.h"
#include "runtime/compiled_graph.h"

namespace kiln::runtime {

class DoubleBackwardReplay {
 public:
  /// `g`: the captured graph as eager runs it (its grad-mode switches kept), `constants[id]` its constants' tensors.
  DoubleBackwardReplay(std::shared_ptr<const graph::Graph> g, std::vector<at::Tensor> constants);

  /// Why the replay would not compute what the forward computed ("" when it would): the graph draws random numbers
  /// (dropout: the replay would draw others), or it updates its inputs in place (batch-norm running statistics: the
  /// replay would read the updated ones and update them again).
  const std::string& refusal() const { return refusal_; }

  /// The gradients of the graph's inputs (undefined where `grad_inputs` has no entry or none flows), with autograd
  /// history, for the gradients `grad_outputs` of its computed outputs (undefined where none came). `computed[i]`: the
  /// graph output that computed output i is. Raises as eager does when an input was changed in place since the
  /// forward (`versions` are the inputs' versions then). Needs: refusal() is empty; grad mode is on.
  std::vector<at::Tensor> gradients(const std::vector<at::Tensor>& inputs, const std::vector<int64_t>& versions,
                                    const std::vector<at::Tensor>& grad_outputs,
                                    const std::vector<size_t>& computed, const std::vector<int32_t>& grad_inputs);

  size_t num_graph_outputs() const { return graph_->outputs.size(); }

  /// Whether a double backward has run. A program trained that way (a physics-informed loss every step) would run its
  /// forward twice per step, compiled and then replayed: from then on its forwards are the replay alone
  /// (record_forward), with eager's autograd history, at eager's speed.
  bool used() const { return used_.load(std::memory_order_relaxed); }
  /// The captured outputs, computed op by op with autograd recording (grad mode as the caller has it).
  std::vector<at::Tensor> record_forward(const std::vector<at::Tensor>& inputs);

 private:
  std::shared_ptr<const graph::Graph> graph_;
  std::vector<at::Tensor> constants_;
  std::string refusal_;
  std::once_flag prepared_;
  std::shared_ptr<CompiledGraph> interpreter_;  // made on the first double backward
  std::atomic<bool> used_{false};
};

}  // namespace kiln::runtime
