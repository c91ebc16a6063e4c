#pragma once
// The min-cut partitioner of ahead-of-time autodiff: which forward values the forward saves for the
// backward and which the backward recomputes (torch-free: graph::Graph only).
#include <cstdint>
#include <vector>

#include "graph/graph.h"

namespace kiln::autodiff {

struct Partition {
  /// Forward values the backward takes as inputs after its gradient inputs, in that order (graph
  /// inputs among them are saved by reference).
  std::vector<graph::ValueId> saved;
  /// Bytes and count of the saved forward intermediates: neither graph inputs (alive anyway) nor the
  /// outputs the forward returns to the caller (returned anyway).
  int64_t saved_bytes = 0;
  int64_t saved_tensors = 0;
  /// The same bytes for the walk's own choice: saving every (non-view) value a derivative rule reads.
  int64_t saved_bytes_before = 0;
  /// Forward nodes the partition copied into the backward to recompute values (views on those chains
  /// included; the views BackwardBuilder recomputes for the rules themselves are not counted).
  int64_t recomputed_nodes = 0;
};

/// Needs: `forward` is the captured graph; `backward` is the graph the joint walk built, whose inputs
/// are `num_gradients` gradients followed by one placeholder per entry of `read` (the forward values the
/// derivative rules read, BackwardBuilder::saved_forward_values()).
/// Decides by a minimum cut over the forward graph (capacities: bytes saved) which values to save so
/// that every value in `read` is either saved or recomputable from saved values by a bounded chain of
/// cheap ops (pointwise, casts, views; never random ops, reductions, matmuls, convolutions or in-place
/// ops), then rebuilds `backward`: its inputs become the gradients followed by Partition::saved, and the
/// recomputation nodes are placed right before their first use. The gradients' inputs, the outputs
/// and every other backward node are kept (remapped); the derivative rules' nodes are untouched.
Partition partition_saved_values(const graph::Graph& forward, const std::vector<graph::ValueId>& read,
                                 size_t num_gradients, graph::Graph& backward);

}  // namespace kiln::autodiff
