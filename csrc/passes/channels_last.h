#pragma once
// Channels-last layout for convolution chains (what cuDNN and oneDNN are fastest with, and what
// torch.compile's layout optimisation does). Torch-free.
#include "graph/graph.h"

namespace kiln::passes {

/// Rewrites `g` so that qualifying convolutions (2-d, not transposed; on CUDA floating with at least 16 input
/// and output channels, on CPU every float32 one) and the layout-keeping ops after them (pointwise, batch norm,
/// max pooling) run on channels-last tensors. Clone nodes go in where a value changes layout; the graph's
/// outputs and every other consumer see the recorded layout, so results, strides and views are unchanged (a
/// value recorded channels-last keeps that layout without a copy). Returns true if it changed the graph.
/// Needs: a verified graph; node order is execution order.
bool relayout_convolutions_channels_last(graph::Graph& g);

}  // namespace kiln::passes
