#pragma once
/// Loop IR -> one CUDA C program for all kernels of a schedule (compiled by NVRTC, codegen/cuda).
///
/// Needs: verified kernels (fusion::verify_kernel). Guarantees: one `extern "C" __global__` function per
/// kernel, named kernel.name, taking one pointer per kernel buffer in order (already offset to the tensor's
/// first element); shapes and strides are compile-time constants (or size arguments); the launch configuration comes
/// with it.
/// Kernels are correct for any grid (grid-stride loops) and never synchronise with the host.
#include <string>
#include <vector>

#include "cache/compiled_artifact.h"
#include "fusion/loop_ir.h"
#include "graph/graph.h"

namespace kiln::codegen::cuda {

/// A kernel's name and launch configuration (grid, block, strategy, part), as the artefact stores it.
using CudaKernelLaunch = cache::KernelEntry;

struct CudaSource {
  std::vector<std::string> parts;  ///< NVRTC programs, each complete (includes, kernels); compile them all
  std::string source;              ///< the parts one after the other (logs, debug dumps, tests)
  std::vector<CudaKernelLaunch> kernels;  ///< one per Schedule::kernels entry, same order
  /// With a launch group: its kernel (`group.grid` blocks in all) and its members (indices into kernels, whose
  /// own entries then name __device__ functions, not launchable kernels; their grids are their block ranges).
  CudaKernelLaunch group;  ///< in part 0
  std::vector<int32_t> group_members;
};

/// Throws kiln::Error for a construct it has no CUDA code for (the caller falls back). `group`: pointwise
/// kernels to emit as one launch (fusion::hoist_input_kernels), or empty. `size_arguments`: kernels read their sizes at
/// run time (codegen/size_arguments.h: a `kiln_sizes<N>` parameter after the buffers, CudaKernelLaunch::sizes its
/// values); no launch group then. `tune` (mode="max-autotune"): every launchable kernel also gets its tuning variants
/// (kernel_schedule.h tuning_candidates), emitted beside it in its part as `<name>_t<i>`, described by its
/// CudaKernelLaunch::variants and tune_key (a twin: its original's); without it the source is what it always was.
CudaSource emit_cuda_source(const fusion::Schedule& schedule, const graph::Graph& g,
                            const std::vector<int32_t>& group = {}, bool size_arguments = false, bool tune = false);

}  // namespace kiln::codegen::cuda
