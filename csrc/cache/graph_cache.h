#pragma once
// Whole compiled graphs on disk (DESIGN.md "Cache keys"): what the kiln backend made of a captured graph (the
// optimised graph, the run plan's kernels and steps, the generated source and how to launch each kernel),
// found again in a new process from the captured graph alone, so that a warm start runs no graph passes, no
// scheduling and no code generation. The compiled library or CUDA images themselves stay in their own caches
// (codegen/cpp, codegen/cuda), keyed by the source this record holds.
//
// Keys hash the captured graph's exact bytes (graph_bytes.h) with everything else compilation depends on: kiln's
// build (its library's size and modification time), the torch version, the device and the backend's flags. An
// entry that fails its checksum or does not parse is ignored (counted in cache::stats) and rebuilt.
//
// Torch-free.
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "codegen/cuda/emit_cuda.h"
#include "fusion/loop_ir.h"
#include "graph/graph.h"

namespace kiln::cache {

/// One generated kernel of the run plan (CUDA: a launch group's members are separate entries).
struct PlannedKernel {
  std::string name;
  std::vector<fusion::KernelBuffer> buffers;  // the kernel's parameters, in order
  std::vector<int32_t> in_place_from;         // fusion::in_place_sources
  bool gathers = false;                       // has gathered loads (CPU: the run plan checks the index error flag)
};

struct GraphRecord {
  graph::Graph optimised;  // constants carry no tensor when read back: the caller attaches the captured graph's
  /// Per value of `optimised`: for a constant, the id of the same constant in the captured graph; else -1.
  std::vector<graph::ValueId> constant_sources;
  std::vector<fusion::Step> steps;
  std::vector<PlannedKernel> kernels;  // per Step::Kind::Kernel index
  std::string cpp_source;                  // CPU
  std::vector<std::string> cpp_functions;  // CPU: per kernel
  std::vector<std::string> cuda_parts;     // CUDA: the NVRTC programs (codegen/cuda/emit_cuda.h)
  std::vector<codegen::cuda::CudaKernelLaunch> cuda_launches;  // CUDA: per kernel
  codegen::cuda::CudaKernelLaunch cuda_group;
  std::vector<int32_t> cuda_group_members;
};

/// The key of `captured` compiled under `context` (device, flags: whatever else the result depends on).
std::string graph_key(const graph::Graph& captured, const std::string& context);

/// The record stored under `key` with the tensors of `captured`'s constants attached (attach_constants), or nullopt
/// when there is none, its constants do not match, or it is unreadable (then it is counted as a corrupt entry and
/// logged under `fallbacks`).
std::optional<GraphRecord> load_graph_record(const std::string& key, const graph::Graph& captured);

/// Stores `record` under `key`, unless one of its constants has no source in the captured graph. I/O errors are
/// logged, never thrown: the cache is an optimisation.
void store_graph_record(const std::string& key, const GraphRecord& record);

/// Per value of `derived` (a graph built from `captured`: passes may renumber values): for a constant, the id of the
/// constant of `captured` holding the same tensor (kUnknownConstant when none does: such a graph is not stored); else -1.
constexpr graph::ValueId kUnknownConstant = -2;
std::vector<graph::ValueId> constant_sources(const graph::Graph& captured, const graph::Graph& derived);

/// Gives the constants of `derived`, read back without tensors, the tensors of the constants of `captured` that
/// `sources` names; false (nothing to use) when they do not match.
bool attach_constants(graph::Graph& derived, const std::vector<graph::ValueId>& sources, const graph::Graph& captured);

/// Other records kept under the same rules as graph records (checksums, atomic writes, kiln's build in the key):
/// `kind` names their folder ("joints": autodiff's forward and backward graphs). nullopt when missing or corrupt.
std::optional<std::string> load_record_bytes(const std::string& kind, const std::string& key);
void store_record_bytes(const std::string& kind, const std::string& key, const std::string& bytes);
/// For a record whose bytes passed their checksum but do not decode: counted as corrupt, logged, then rebuilt.
void ignore_unreadable(const std::string& kind, const std::string& key, const std::exception& e);

/// "<size>-<mtime ns>" of the shared library this code is linked into (kiln's build), "" when unknown.
const std::string& build_identity();

}  // namespace kiln::cache
