#pragma once
// Training-mode batch norm on CUDA as cuDNN's kernel, the one eager runs. Torch-free.
//
// The tracer records batch norm on meta tensors, where ATen's `_batch_norm_impl_index` takes its native
// path: the graph holds `native_batch_norm`, so a replay or a compiled graph would run ATen's own CUDA
// kernels (on an H200, ResNet-50's batch-norm backward took 4.7 ms per step that way against about 3 ms for
// cuDNN's). Eager, on real CUDA tensors, calls `cudnn_batch_norm` when cuDNN accepts the arguments. This
// rewrite makes the same choice after recording: a `native_batch_norm(training=True)` node that eager would
// have sent to cuDNN becomes `cudnn_batch_norm`, whose backward (`cudnn_batch_norm_backward`, autodiff's
// derivative rules) reads the workspace the forward returns. The joint builder runs it before the split
// (autodiff/build_joint_graphs), and compile/ before the eager interpreter replays a graph that needs grad.
#include "graph/graph.h"
#include "graph/op_oracle.h"

namespace kiln::passes {

/// What the running torch offers: cuDNN compiled in and enabled (torch.backends.cudnn.enabled), and the
/// smallest epsilon its batch norm takes.
struct CudnnBatchNorm {
  bool available = false;
  double min_epsilon = 0.0;
};

/// Needs: `g` a captured graph; `oracle` answers cudnn_batch_norm's metas; `cudnn` says what the running torch
/// offers (nothing changes when cuDNN is not available). Rewrites the qualifying nodes of `g` as above (eager's
/// conditions: CUDA, float32 or float16 input with float32 weight, weight and bias given, both running statistics or
/// neither, at least 3 dims, a batch of at most 880801, eps at least cuDNN's minimum, an input dense in its suggested
/// layout, and cuDNN's meta kernel laying the results out as recorded). Guarantees: results 0-2 keep their ids and
/// recorded metas; the workspace is a new value recorded as an empty byte vector (is_opaque_workspace): its real size
/// is cuDNN's choice at run time, and the runtime passes such a value through unchanged. Returns true if it changed
/// `g`.
bool use_cudnn_batch_norm(graph::Graph& g, graph::OpOracle& oracle, const CudnnBatchNorm& cudnn);

/// True for a value recorded as an empty byte vector: a kernel's workspace whose size only the kernel knows (the
/// workspace use_cudnn_batch_norm adds; the runtime reads this to leave such values as they are).
bool is_opaque_workspace(const graph::TensorMeta& meta);

}  // namespace kiln::passes
