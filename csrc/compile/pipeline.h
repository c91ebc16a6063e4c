#pragma once
// The "kiln" backend's pipeline: a captured graph and the compile options in, a runnable graph out. One straight
// line, read top to bottom in pipeline.cpp:
//   functionalize in-place ops -> fold constants -> the autodiff split (a graph that needs grad becomes a forward
//   and a backward graph, each sent through the rest) -> graph passes in order -> schedule kernels -> emit (the
//   device backend) -> a CompiledArtifact, stored in the graph cache -> runtime/ loads and runs it.
// Any failure on the way runs the graph on the eager interpreter instead: a compiler problem costs speed, never an
// answer.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cache/compiled_artifact.h"
#include "compile/options.h"
#include "graph/graph.h"
#include "runtime/compiled_graph.h"
#include "runtime/kernel_graph.h"

namespace kiln::compile {

/// Compiles `g` into fused kernels plus extern ATen calls. Graphs it cannot compile (grad mode switched over values
/// that require grad, devices other than CPU and CUDA) and any failure on the way (no compiler, a compile error) run
/// on the eager interpreter instead, with one `fallbacks` log line. Call with the GIL held (it is released while
/// compilers run). `training_half`: `g` is the forward or backward half of a compiled training step. Under CUDA
/// graphs (options.uses_cudagraphs()), `escaping` is how many of the first outputs reach the caller (runtime/
/// cuda_graphs.h); the others stay inside kiln (a training forward's saved values).
std::shared_ptr<runtime::CompiledGraph> compile_kiln_graph(std::shared_ptr<const graph::Graph> g,
                                                           const runtime::ConstantsOf& constants_of,
                                                           const CompileOptions& options, bool training_half = false,
                                                           size_t escaping = SIZE_MAX);

/// Times of one lowering, for KILN_LOGS=perf.
struct LoweringTimes {
  double passes_ms = 0;   // graph passes and scheduling
  double emit_ms = 0;     // code generation
};

/// The lowering proper, for a graph with no in-place op that needs no grad, on `device`: the graph passes in order,
/// the kernel schedule and the device backend's code. Throws kiln::Error for a construct it cannot lower.
cache::CompiledArtifact lower_graph(const graph::Graph& captured, const graph::Device& device,
                                    const CompileOptions& options, bool training_half, LoweringTimes& times);

/// Whether graphs that need grad compile as forward + backward behind one autograd node (csrc/autodiff): on by
/// default; kiln.config.set_compiled_autograd(False) runs them on the eager interpreter, which records eager's
/// autograd history op by op.
void set_compiled_autograd(bool on);
bool compiled_autograd();

/// Test switch: every CPU graph the pipeline lowers is also emitted as CUDA C and compiled to PTX by NVRTC, so CUDA
/// code generation is checked on machines without a GPU. Failures are collected here.
struct CudaPtxCheck {
  int64_t compiled = 0;
  std::vector<std::string> failures;  // NVRTC's message and the source, per failing graph
};
void set_cuda_ptx_check(bool on);
CudaPtxCheck& cuda_ptx_check();

}  // namespace kiln::compile
