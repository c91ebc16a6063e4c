#pragma once
// In-place updates of graph inputs that never require grad (BatchNorm's num_batches_tracked.add_(1), a
// hand-written running statistic), rewritten as functional ops whose final value the runtime writes back
// into the input after the forward. Torch-free.
#include <cstdint>
#include <vector>

#include "graph/graph.h"

namespace kiln::passes {

struct BufferUpdate {
  int32_t input_index;      // the captured input the forward updates
  graph::ValueId final_value;  // the value (in the rewritten graph) to copy into it after the forward
};

/// Needs: `g` is a captured graph. Rewrites each in-place op whose written tensor is a graph input that
/// does not require grad (directly, or through earlier such updates), whose other operands neither require
/// grad nor change its dtype, and which is in the table of updates with a functional twin (add_, sub_,
/// mul_, div_, copy_, fill_, zero_, lerp_), into that twin; later readers of the input or of the in-place
/// result read the new value. Returns one BufferUpdate per updated input, in input order. Guarantees: the
/// other nodes are untouched (so any other in-place op stays and the caller refuses it). Throws
/// Unsupported when an updated value is a graph output (eager would return the input itself).
/// The caller must also refuse the graph when the backward reads an updated input by reference (it would
/// see the written-back value: eager raises a version-counter error there).
std::vector<BufferUpdate> functionalize_buffer_updates(graph::Graph& g);

}  // namespace kiln::passes
