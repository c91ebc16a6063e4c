#pragma once
// mode="reduce-overhead" (and options={"cudagraphs": True}): a compiled graph replayed as a CUDA graph, so one call
// costs one graph launch instead of a launch per kernel and extern call.
//
// How a graph is recorded and replayed (CudaGraphRunner, cuda_graphs.cpp):
// - The first call runs the graph as usual (warm-up: cuBLAS handles, lazy module loads). The second records it
//   on a side stream into the memory pool of its compiled model, then replays it; later calls replay.
// - Inputs: one at the same address on the warm-up and the recording call (a parameter, a buffer, a saved value the
//   forward left for the backward) is read in place, and must be at that address again for a replay; any other is
//   copied into a static buffer before each replay. An in-place input that moves makes that slot a copied one and
//   records again, a bounded number of times.
// - Outputs handed to the caller are copied out of the pool after each replay: kiln never hands back memory that a
//   later replay overwrites, whether the caller keeps the output or not. Outputs that stay inside kiln (the values a
//   training forward saves for its backward, buffer updates written back at once) are handed over in place; before a
//   replay, every such output of the pool still referenced elsewhere must have been alive when this graph was
//   recorded (so the recording kept clear of its memory), else the call runs unrecorded, in fresh memory.
// - Declined, with a reason (KILN_LOGS=cudagraphs, cudagraph_status), and run as before: tensors not on one CUDA
//   device, inputs that require grad under grad mode, outputs sharing memory with inputs, a recording that fails
//   (host synchronisation, an op that cannot be captured), inputs that keep changing address.
//
// runtime/ stays free of CPython: the recording itself goes through torch's CUDA graph object, which the embedding
// layer provides as a CudaGraphApi (bindings/module_cuda_graphs.cpp).
#include <cstdint>
#include <memory>
#include <string>

#include "runtime/compiled_graph.h"

namespace kiln::runtime {

/// Recording and replaying through torch's CUDA graphs, as the embedding layer provides them. Each function returns
/// false (or null) with `error` set on failure, and may be called from any thread (the autograd engine's).
struct CudaGraphApi {
  /// A new memory pool on `device` for the graphs of one compiled model. The allocator keeps it while the handle
  /// lives, whether or not any recording in it does.
  void* (*new_pool)(int device, std::string* error) = nullptr;
  /// Starts recording into `pool`, on a side stream of its device; returns the recording's handle.
  void* (*begin)(void* pool, std::string* error) = nullptr;
  /// Ends the recording `capture` began; returns the graph (null when the recording failed: `error` says why). The
  /// capture handle is released either way.
  void* (*end)(void* capture, std::string* error) = nullptr;
  /// Replays `graph` on the current stream.
  bool (*replay)(void* graph, std::string* error) = nullptr;
  /// Releases a pool or graph handle.
  void (*release)(void* handle) = nullptr;
};
void set_cuda_graph_api(CudaGraphApi api);

/// The memory pool and the recordings of one compiled model (one kiln.compile call): every graph it records shares
/// the pool, so the forward, the backward and the graphs around a break reuse each other's intermediate memory.
class CudaGraphPool;
std::shared_ptr<CudaGraphPool> make_cuda_graph_pool();

/// Wraps `inner` (a graph compiled for one device) to replay as a CUDA graph in `pool`. Outputs [0, escaping) are
/// handed to the caller (copied out after each replay); the others stay inside kiln (see above). `declined`: why
/// `inner` will never be recorded (it runs on the CPU, or on the eager interpreter), reported by cudagraph_status().
std::shared_ptr<CompiledGraph> make_cuda_graph_runner(std::shared_ptr<CompiledGraph> inner,
                                                      std::shared_ptr<CudaGraphPool> pool, size_t escaping,
                                                      std::string name, std::string declined = "");

/// Process-wide counters, for kiln.stats().
struct CudaGraphStats {
  int64_t recordings = 0;      // graphs recorded
  int64_t replays = 0;         // calls answered by a replay
  int64_t unrecorded_runs = 0; // calls of a recorded graph that ran unrecorded (memory of the pool still in use)
  int64_t declined = 0;        // graphs that will not be recorded
  std::string last_decline_reason;
};
CudaGraphStats& cuda_graph_stats();

}  // namespace kiln::runtime
