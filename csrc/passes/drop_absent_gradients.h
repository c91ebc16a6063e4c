#pragma once
// A backward graph for a call where some outputs of the forward got no gradient (an output the loss never used: the
// logits beside a model's loss). Torch-free.
//
// Design: eager's engine never builds a path for such an output, so its gradient is added nowhere; the compiled
// backward, built for every gradient, reads one input per output. Filling that input with zeros and adding it in costs
// a write and a read of a tensor the size of the output (for a language model's logits, two passes over
// batch x length x vocabulary floats). Here the input is gone: its value is a zero fill (a constant in whichever
// kernel still reads it), and each sum it takes part in (`x + 0`, `x - 0`, `0 + x`) is the other operand, as eager
// computes it. Whether the other operand can stand for the sum is decided as simplify_algebra decides it: same dtype,
// sizes, strides and offset, and the sum is not a graph output (a gradient handed on must be a tensor of its own).
#include <memory>
#include <vector>

#include "graph/graph.h"

namespace kiln::passes {

/// `backward` with input j removed wherever absent[j] (j indexes its inputs: the incoming gradients come first), each
/// replaced by a zero fill that the sums it reaches no longer read. Null where this is not done: a node writes in
/// place, the sizes are symbolic, or an absent input's meta is not dense and contiguous. How many sums were dropped
/// goes to `dropped` when given.
std::shared_ptr<graph::Graph> drop_absent_gradients(const graph::Graph& backward, const std::vector<bool>& absent,
                                                    int* dropped = nullptr);

}  // namespace kiln::passes
