#pragma once
// Batch norm in inference (running statistics, training=False) rewritten as pointwise ATen ops, so that it
// fuses with the activation and residual add around it instead of running as its own ATen kernel.
// Torch-free.
#include "graph/graph.h"

namespace kiln::passes {

/// Rewrites float32 `native_batch_norm(training=False)`, `cudnn_batch_norm(training=False)` and
/// `_native_batch_norm_legit_no_training` calls whose statistics outputs nobody reads into
/// (x - mean) * rsqrt(var + eps) * weight + bias over [C, 1, ...] views of the per-channel vectors; a 16-bit input
/// with float32 statistics (autocast) is normalised in float32 and cast back once, as ATen computes it. Returns
/// true if it changed the graph.
bool lower_inference_batch_norm(graph::Graph& g);

}  // namespace kiln::passes
