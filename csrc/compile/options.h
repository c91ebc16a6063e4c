#pragma once
// CompileOptions: what kiln.compile's `mode`, `dynamic` and `options` arguments ask of the compiler, carried from
// the Python API (python/kiln/api.py validates them and names the mistakes) through the frame compiler
// (trace/compile_frame.h) to the pipeline (compile/pipeline.h), which reads them and puts the part that changes
// generated code into every cache key. Torch-free.
#include <memory>
#include <string>

#include "passes/split_at_parameter_buckets.h"

namespace kiln::runtime {
class CudaGraphPool;  // runtime/cuda_graphs.h
}

namespace kiln::compile {

/// torch.compile's modes: kReduceOverhead replays CUDA graphs (runtime/cuda_graphs.h); the max-autotune modes time
/// each kernel's schedule variants and each matmul's BLAS library (runtime/autotune.h), kMaxAutotune with CUDA graphs.
enum class Mode { kDefault, kReduceOverhead, kMaxAutotune, kMaxAutotuneNoCudagraphs };

/// torch.compile's `dynamic`: None (automatic), False (always specialise), True (symbolic from the first call).
enum class Dynamic { kAutomatic, kStatic, kDynamic };

struct CompileOptions {
  Mode mode = Mode::kDefault;
  Dynamic dynamic = Dynamic::kAutomatic;
  /// options={"cudagraphs": True}: what mode="reduce-overhead" does. {"autotune": True}: what
  /// mode="max-autotune-no-cudagraphs" does.
  bool cudagraphs = false;
  bool autotune = false;
  /// options={"debug_dir": path}: graphs and generated sources of this compile are written there, as
  /// KILN_DEBUG_DIR does for every compile; empty: KILN_DEBUG_DIR, if set.
  std::string debug_dir;
  /// The memory pool of the CUDA graphs of one kiln.compile call (runtime/cuda_graphs.h), shared by every copy of
  /// these options; made by the binding when uses_cudagraphs().
  std::shared_ptr<runtime::CudaGraphPool> cuda_graph_pool;
  /// Set by the tracer for a frame running inside a DistributedDataParallel forward: the graph inputs that are the
  /// parameters DDP reduces, and its bucket sizes. A training graph holding more than one bucket's worth is compiled
  /// in pieces (passes/split_at_parameter_buckets.h), so each bucket's all-reduce overlaps the rest of the backward.
  /// Not in cache_key(): each piece is keyed as the graph it is.
  std::shared_ptr<const passes::ParameterBuckets> parameter_buckets;
  /// Set for the concrete graphs a DynamicGraph compiles per binding of its size symbols (compile/backends.cpp):
  /// generated kernels read their sizes, strides and offsets from a per-kernel array of run-time values
  /// (codegen/size_arguments.h) instead of literals, so every binding with the same schedule decisions has the same
  /// sources and finds its kernels in the caches. Part of cache_key().
  bool size_arguments = false;

  /// True when compiled CUDA graphs replay as CUDA graphs: mode="reduce-overhead", mode="max-autotune" (as torch.compile's,
  /// which turns CUDA graphs on too) or options={"cudagraphs": True}.
  bool uses_cudagraphs() const { return cudagraphs || mode == Mode::kReduceOverhead || mode == Mode::kMaxAutotune; }
  /// True when kernels come with alternatives to time at the first call (codegen/device_backend.h emit's `tune`):
  /// options={"autotune": True}, mode="max-autotune" or "max-autotune-no-cudagraphs".
  bool tunes() const { return autotune || mode == Mode::kMaxAutotune || mode == Mode::kMaxAutotuneNoCudagraphs; }

  /// The options that change what the pipeline generates, as text for cache keys: two compiles whose options
  /// differ here never share a cache entry. (debug_dir only adds files, and CUDA graphs only change how the same
  /// code is launched, so neither is part of it: reduce-overhead finds default's kernels in the cache.)
  std::string cache_key() const;
  /// Where graphs and sources are dumped: debug_dir, else KILN_DEBUG_DIR, else "" (no dumps).
  std::string dump_dir() const;
};

const char* mode_name(Mode mode);
/// The Mode named as torch.compile names it ("default", "reduce-overhead", ...); throws a user error otherwise.
Mode parse_mode(const std::string& name);

}  // namespace kiln::compile
