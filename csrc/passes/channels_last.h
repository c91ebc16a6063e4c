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
/// `cpu` false leaves CPU convolutions alone: graphs that are halves of a training step, because oneDNN's
/// channels-last weight gradient of a strided 1x1 convolution crashes at some shapes in torch 2.13's CPU
/// build (eager on channels-last tensors too: batch 3, 8 -> 16 channels, stride 2, 16x16).
/// Needs: a verified graph; node order is execution order.
bool relayout_convolutions_channels_last(graph::Graph& g, bool cpu = true);

}  // namespace kiln::passes
