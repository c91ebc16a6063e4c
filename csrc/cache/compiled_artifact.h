#pragma once
// CompiledArtifact: what the pipeline makes of one captured graph (compile/pipeline.h), device-neutral: the
// optimised graph, the run plan's steps and kernels, and the device code as one device backend emitted it
// (codegen/device_backend.h). The pipeline makes it, this folder stores it (graph_cache.h), runtime/ loads its code
// through the same device backend and runs it (runtime/kernel_graph.h). Defined here, the lowest layer that handles
// it, so that storing it needs nothing above the cache. Plain data; torch-free.
#include <cstdint>
#include <string>
#include <vector>

#include "fusion/loop_ir.h"
#include "graph/graph.h"

namespace kiln::cache {

/// One kernel of the run plan as the device code names and launches it.
struct KernelEntry {
  std::string name;      ///< the function that runs it (CPU: a C function; CUDA: a __global__ kernel)
  unsigned grid = 0;     ///< CUDA: blocks (0: an empty domain, nothing to launch); CPU: unused
  unsigned block_x = 1;  ///< CUDA: threads per row group (pointwise: per block)
  unsigned block_y = 1;  ///< CUDA: rows per block (warp-per-row reductions)
  std::string strategy;  ///< CUDA: how it maps onto threads ("pointwise_vec4", "warp_per_row", ...: logs, tests)
  int part = 0;          ///< which of DeviceCode::parts defines it
  /// DeviceCode::size_arguments: the values of the kernel's size slots (codegen/size_arguments.h), passed at each
  /// launch; empty otherwise.
  std::vector<int64_t> sizes;
  /// CUDA, mode="max-autotune" (codegen/cuda/kernel_schedule.h tuning_candidates): the kernel's alternative schedules,
  /// after this default one, each a complete launchable entry (its own name, `<name>_t<i>`, grid, block, strategy
  /// and sizes) in the same part; empty otherwise, and in the entries of variants themselves.
  std::vector<KernelEntry> variants;
  /// With variants: the hex SHA-256 of the default's and the variants' code (with the kernel's own name left out, so
  /// that the same kernel in another graph has the same key) and launches (grid, block, sizes). The same key means
  /// the same choice to time, so a tuning result may be remembered under it. Empty without variants.
  std::string tune_key;
};

/// The generated code of a graph for one device backend.
struct DeviceCode {
  std::string backend;             ///< the device backend that emitted it and loads it ("cpp", "cuda")
  std::vector<std::string> parts;  ///< complete programs (CPU: one translation unit; CUDA: NVRTC programs)
  std::vector<KernelEntry> kernels;  ///< one per PlannedKernel, same order
  /// A launch group (CUDA: pointwise kernels that read only graph inputs, run as one launch): its kernel and its
  /// members (indices into kernels, whose own entries then name device functions, not launchable kernels).
  KernelEntry group;
  std::vector<int32_t> group_members;
  /// Emitted with size arguments (compile::CompileOptions::size_arguments): every kernel takes its KernelEntry::sizes
  /// at run time (CPU: a second parameter, `const int64_t*`; CUDA: a struct of them by value after the buffers, where
  /// it has any).
  bool size_arguments = false;

  bool empty() const { return parts.empty(); }
  /// The parts one after the other (logs, debug dumps, summaries).
  std::string source() const {
    std::string text;
    for (const std::string& part : parts) text += part;
    return text;
  }
};

/// One generated kernel of the run plan (a launch group's members are separate entries).
struct PlannedKernel {
  std::string name;
  std::vector<fusion::KernelBuffer> buffers;  // the kernel's parameters, in order
  std::vector<int32_t> in_place_from;         // fusion::in_place_sources
  bool gathers = false;                       // checks indices (fusion::Kernel::checks_indices: CPU reads the flag)
};

struct CompiledArtifact {
  graph::Graph optimised;  // constants carry no tensor when read back: the caller attaches the captured graph's
  /// Per value of `optimised`: for a constant, the id of the same constant in the captured graph; else -1.
  std::vector<graph::ValueId> constant_sources;
  std::vector<fusion::Step> steps;
  std::vector<PlannedKernel> kernels;  // per Step::Kind::Kernel index
  DeviceCode code;                     // empty when the graph has no generated kernel (extern calls only)
};

}  // namespace kiln::cache
