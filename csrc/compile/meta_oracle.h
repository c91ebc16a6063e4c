#pragma once
// What compile/ asks the running torch about ops: the metas of a node's results (the graph::OpOracle that the
// joint builder and the passes adding nodes use), and what cuDNN offers batch norm here.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "graph/op_oracle.h"
#include "passes/use_cudnn_batch_norm.h"

namespace at {
class Tensor;
}  // namespace at

namespace kiln::compile {

/// An oracle that gives each node asked about the metas kiln's shape rules (graph/shape_rules.h) give at its arguments'
/// concrete sizes, else runs it on meta tensors shaped like its arguments (the op's meta kernel through the
/// dispatcher). It keeps those meta tensors by value id between calls (one oracle serves a captured graph's rewrites,
/// then its backward graph). Call with grad mode off.
std::unique_ptr<graph::OpOracle> make_meta_oracle();

/// What `op` ("aten::add.Tensor") returns on `args` (a node's arguments; each tensor's meta from `meta_of`) by kiln's
/// shape rules at concrete sizes, as meta-device tensors in `outputs` (undefined where the op returns None): true, or
/// false where no rule answers (torch's meta kernel decides). Needs no GIL.
bool meta_outputs_from_rules(const std::string& op, const std::vector<graph::ArgValue>& args,
                             const std::function<const graph::TensorMeta&(graph::ValueId)>& meta_of,
                             std::vector<at::Tensor>& outputs);

/// cuDNN as the running torch offers it to batch norm: compiled in and enabled (torch.backends.cudnn.enabled), and
/// its smallest epsilon.
passes::CudnnBatchNorm cudnn_batch_norm_here();

}  // namespace kiln::compile
