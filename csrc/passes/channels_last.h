#pragma once
// Channels-last layout for convolution chains on CUDA (what cuDNN is fastest with, and what torch.compile's
// layout optimisation does). Torch-free.
#include "graph/graph.h"

namespace kiln::passes {

/// Rewrites `g` so that qualifying convolutions (CUDA, 2-d, floating, not transposed, at least 16 input and
/// output channels) and the layout-keeping ops after them (pointwise, batch norm, max pooling) run on
/// channels-last tensors. Clone nodes go in where a value changes layout; the graph's outputs and every other
/// consumer see the recorded layout, so results, strides and views are unchanged. Returns true if it changed
/// the graph. Needs: a verified graph; node order is execution order.
bool relayout_convolutions_channels_last(graph::Graph& g);

}  // namespace kiln::passes
