#pragma once
// Cross entropy without its log_softmax: `nll_loss_forward(_log_softmax(x, 1), target, None, reduction, ignore)`,
// what F.cross_entropy records, reads one element per row of the log_softmax, yet eager (and kiln before this pass)
// writes all of it: N x C values, 206 MB for GPT-2's 1024 x 50257 logits, and a training step saves them for
// _log_softmax_backward_data while nll_loss_backward zero-fills and scatters another N x C. The pass computes only
// what the loss reads, in ATen ops that fusion and autodiff already know:
//
//   lse = logsumexp(x, [1], keepdim)             one row reduction over x, nothing written but [N, 1]
//   ignored = target[:, None] == ignore_index
//   safe = target[:, None].masked_fill(ignored, 0)
//   losses = (lse - x.gather(1, safe)).masked_fill(ignored, 0)
//   none: losses[:, 0]; sum: losses.sum(); mean: losses.sum() / (~ignored).sum(dtype=x.dtype)
//
// as ATen defines the loss (all targets ignored: mean is 0 / 0 = nan, sum 0). Autodiff then gives the backward as
// one pointwise pass over x, exp(x - lse) * g plus the gather's gradient, a scatter with one index per row that
// decomposes to where(iota == safe, ...) (decomp/decompose_gather.cpp), and the forward saves [N, 1] values only.
// A 1-d input (no batch) is the same over x[None] and target[None]. Left alone: a log_softmax something else reads,
// a class weight, other dims, 16-bit inputs (eager rounds the log_softmax to 16 bits before the pick), and `none`
// over a 2-d input whose total_weight is read. Torch-free.
#include "graph/graph.h"
#include "graph/op_oracle.h"

namespace kiln::passes {

/// Whether `g` holds an nll_loss_forward (callers make an oracle only then).
bool has_cross_entropy(const graph::Graph& g);

/// Needs: a verified graph; `oracle` answers the metas of the ops above. Rewrites each nll_loss_forward as above, in
/// place: the new nodes take its position, its two results keep their value ids and metas, new values need grad where
/// they are computed from x and x does, and the log_softmax is left without readers for the dead-node sweep. No value
/// is renumbered. Returns true if it changed the graph.
bool lower_cross_entropy(graph::Graph& g, graph::OpOracle& oracle);

}  // namespace kiln::passes
