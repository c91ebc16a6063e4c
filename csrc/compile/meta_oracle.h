#pragma once
// What compile/ asks the running torch about ops: the metas of a node's results (the graph::OpOracle that the
// joint builder and the passes adding nodes use), and what cuDNN offers batch norm here.
#include <memory>

#include "graph/op_oracle.h"
#include "passes/use_cudnn_batch_norm.h"

namespace kiln::compile {

/// An oracle that runs each node asked about on meta tensors shaped like its arguments: kiln's own meta rules
/// (kiln/_meta_rules.py, oracle_infer) where one answers, else the op's meta kernel through the dispatcher. It keeps
/// those meta tensors by value id between calls (one oracle serves a captured graph's rewrites, then its backward
/// graph). Call with grad mode off; it takes the GIL for the Python rules itself.
std::unique_ptr<graph::OpOracle> make_meta_oracle();

/// cuDNN as the running torch offers it to batch norm: compiled in and enabled (torch.backends.cudnn.enabled), and
/// its smallest epsilon.
passes::CudnnBatchNorm cudnn_batch_norm_here();

}  // namespace kiln::compile
