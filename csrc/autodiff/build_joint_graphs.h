#pragma once
// Ahead-of-time autodiff: one captured graph -> a forward graph and a backward graph.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "autodiff/backward_builder.h"
#include "graph/graph.h"
#include "graph/op_oracle.h"
#include "passes/use_cudnn_batch_norm.h"

namespace kiln::autodiff {

struct JointGraphs {
  /// The captured graph with no requires_grad flags (it runs with grad off) and its buffer updates made
  /// functional (passes/functionalize_buffer_updates.h); its outputs are the captured outputs, then the new
  /// value of each updated input, then the saved intermediates (saved_from_input[i] < 0).
  std::shared_ptr<graph::Graph> forward;
  /// Inputs: one gradient per differentiable captured output (in output order), then the saved values.
  /// Outputs: one gradient per captured input that requires grad (in input order).
  std::shared_ptr<graph::Graph> backward;
  size_t num_outputs = 0;                 // computed captured outputs (the forward graph's first outputs)
  /// Per captured output: -1 for the computed outputs, which follow in order; else the captured input it is (the
  /// runtime returns the caller's tensor itself, as eager does) or that the chain of views making it starts from:
  /// output_views[i] is then a graph of one input and those views, which the runtime replays on the caller's
  /// tensor, so that the output is eager's view (storage, version counter and autograd history). Both empty
  /// when every output is computed.
  std::vector<int32_t> output_inputs;
  std::vector<std::shared_ptr<graph::Graph>> output_views;
  /// Captured inputs the forward updates in place (BatchNorm's num_batches_tracked): after the forward
  /// runs, input updated_inputs[i] receives forward output num_outputs + i (the runtime copies it in).
  std::vector<int32_t> updated_inputs;
  std::vector<bool> output_differentiable;  // per captured output: floating and requires grad
  /// Per saved value (backward inputs after the gradients): the captured input index it is, or -1 when
  /// it is a forward intermediate (taken from the forward's outputs in order).
  std::vector<int32_t> saved_from_input;
  std::vector<int32_t> grad_inputs;  // backward output i is the gradient of captured input grad_inputs[i]
  /// The partition (partition.h): bytes and count of the saved forward intermediates (graph inputs and
  /// returned outputs excluded), the bytes saving every value the rules read would have kept, and the
  /// forward nodes the backward recomputes.
  int64_t saved_bytes = 0;
  int64_t saved_tensors = 0;
  int64_t saved_bytes_before_partition = 0;
  int64_t recomputed_nodes = 0;
};

/// Builds the joint graphs. Outputs that are graph inputs or views of one stay out of both graphs (output_inputs).
/// The backward reads forward values as saved tensors or recomputes them
/// (views from their base; cheap pointwise chains from cheaper saved values, chosen by a min cut:
/// partition.h); inputs are saved by reference (no forward output needed). Throws kiln::Error of kind Unsupported (naming the op) when
/// a node on a gradient path has no derivative rule, a non-differentiable result receives a gradient,
/// or the graph mutates something it must not (anything but BatchNorm's statistics and in-place updates
/// of inputs that do not require grad and that the backward does not read); callers then keep the eager
/// interpreter. Before the split, CUDA convolution chains are relaid channels-last (passes/channels_last.h)
/// and training-mode batch norm takes cuDNN's kernel where `cudnn` allows it (passes/use_cudnn_batch_norm.h).
JointGraphs build_joint_graphs(const graph::Graph& captured, graph::OpOracle& oracle,
                               const passes::CudnnBatchNorm& cudnn = {});

}  // namespace kiln::autodiff
