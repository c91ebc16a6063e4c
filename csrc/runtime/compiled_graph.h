#pragma once
// The runnable form of a captured graph, whatever backend produced it. Callers (the frame hook's cache
// entries) hold it by shared_ptr and call run() with the frame's tensors in graph input order.
// Only Tensor.h-level includes here so that every caller stays cheap to compile.
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace kiln::runtime {

class CompiledGraph {
 public:
  virtual ~CompiledGraph();
  /// Runs the graph on real tensors; returns the graph outputs in order. With grad mode on and inputs
  /// that require grad, the outputs carry autograd history exactly as eager would build it.
  virtual std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs) = 0;
  /// Like run(), for a caller that hands over its only references to the inputs: a backend may then free
  /// each input after its last use (a backward graph's saved activations, released as the backward goes).
  virtual std::vector<at::Tensor> run_consuming(std::vector<at::Tensor>&& inputs) { return run(inputs); }
  /// run() (or run_consuming() when `consuming`), where outputs[i] for each `packed[i]` is long-lived: a leaf
  /// gradient that AccumulateGrad keeps as `.grad`. The kiln backend then places those outputs side by side in a
  /// few large allocations (kernel_graph.cpp) rather than one caching-allocator block each.
  virtual std::vector<at::Tensor> run_packing(std::vector<at::Tensor>&& inputs, bool consuming,
                                              const std::vector<bool>& packed) {
    (void)packed;
    return consuming ? run_consuming(std::move(inputs)) : run(inputs);
  }
  /// True when run() calls back into Python (user backends): the caller then runs it with the frame
  /// hook's compiler suspended, so the backend's own Python is never traced.
  virtual bool reenters_python() const { return wrapped() && wrapped()->reenters_python(); }
  /// Under mode="reduce-overhead": whether this graph replays as a CUDA graph (runtime/cuda_graphs.h), for
  /// kiln.explain: "recorded, 12 replays", "declined: <why>", ...; "" when no CUDA graph was asked for. Wrappers
  /// report what they wrap; a training graph reports its halves ("forward: ...; backward: ...").
  virtual std::string cudagraph_status() const { return wrapped() ? wrapped()->cudagraph_status() : ""; }
  /// The graph this one wraps and runs (a CUDA graph runner's, a buffer-updating wrapper's), or null.
  virtual const CompiledGraph* wrapped() const { return nullptr; }
};

}  // namespace kiln::runtime
