#pragma once
// The "kiln" backend: decompose, fuse, generate C++/OpenMP, compile (cached), and run the schedule.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "graph/graph.h"
#include "runtime/compiled_graph.h"

namespace kiln::runtime {

/// The real constant tensors of a graph, indexed by ValueId (backends.cpp owns the Python conversion).
using ConstantsOf = std::function<std::vector<at::Tensor>(const graph::Graph&)>;

/// Compiles `g` into fused kernels plus extern ATen calls. Graphs it cannot compile (in-place ops, grad
/// mode with inputs that require grad, non-CPU tensors) and any failure on the way (no compiler, a compile
/// error) run on the eager interpreter instead, with one `fallbacks` log line. Call with the GIL held
/// (it is released while the C++ compiler runs).
/// `training_half`: `g` is the forward or backward half of a compiled training step (autograd_graph.h).
std::shared_ptr<CompiledGraph> compile_kiln_graph(std::shared_ptr<const graph::Graph> g, const ConstantsOf& constants_of,
                                                  bool training_half = false);

/// What compile_kiln_graph made of a graph, for tests and tools.
struct KilnGraphSummary {
  std::string backend;          // "kiln" (kernels) or "eager" (fell back)
  std::string fallback_reason;  // why it fell back, "" otherwise
  std::vector<std::string> kernels;  // kernel names in execution order
  std::vector<std::string> externs;  // op overloads of extern calls, in order
  std::vector<std::string> plan;     // the run plan's steps in order: a kernel's (or launch group's) name, an extern's op
  std::string source;                // the generated C++ or CUDA C ("" on fallback)
  std::string device;                // "cpu" or "cuda:N" ("" on fallback)
  std::vector<std::string> strategies;  // CUDA: per kernel, how it maps onto threads (emit_cuda.h)
  std::vector<std::string> in_place;    // "kernel: %out into %in" for outputs that may take an input's storage
  std::vector<std::string> folded;      // "%7 = f32[8, 8] from aten::triu.default": values computed at compile time
};

/// The summary of a graph compiled by compile_kiln_graph, or nullptr for any other CompiledGraph.
const KilnGraphSummary* kiln_graph_summary(const CompiledGraph& compiled);

/// Process-wide counters of the kiln backend (graphs compiled, fallbacks).
struct KilnBackendStats {
  int64_t graphs_compiled = 0;
  int64_t graphs_fallback = 0;
  int64_t graphs_autograd = 0;  // graphs compiled as forward + backward behind one autograd node
  int64_t autograd_saved_bytes = 0;       // summed over those graphs: bytes of saved forward intermediates
  int64_t autograd_recomputed_nodes = 0;  // summed over those graphs: forward nodes the backward recomputes
  std::string last_fallback_reason;
};
KilnBackendStats& kiln_backend_stats();

/// Whether graphs that need grad compile as forward + backward behind one autograd node (csrc/autodiff).
/// Off by default: on CPU the compiled training step is still slower than eager's (benchmarks/README.md),
/// so such graphs run on the eager interpreter, which records eager's autograd history op by op.
/// kiln.config.set_compiled_autograd(True) turns it on for the process.
void set_compiled_autograd(bool on);
bool compiled_autograd();

/// Test switch: every CPU graph the kiln backend compiles is also emitted as CUDA C and compiled to PTX by
/// NVRTC, so CUDA code generation is checked on machines without a GPU. Failures are collected here.
struct CudaPtxCheck {
  int64_t compiled = 0;
  std::vector<std::string> failures;  // NVRTC's message and the source, per failing graph
};
void set_cuda_ptx_check(bool on);
CudaPtxCheck& cuda_ptx_check();

}  // namespace kiln::runtime
