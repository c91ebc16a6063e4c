#pragma once
// Compile-and-load for one device, cached in memory for the life of the process: the same source with the
// same flags on the same device is compiled by NVRTC and loaded by the driver once. Below that, compiled
// images are cached on disk (KILN_CACHE_DIR/cuda), keyed by the source, the device helper headers, NVRTC's
// version, the flags and the architecture, so a new process skips NVRTC.
#include <memory>
#include <string>
#include <vector>

#include "codegen/cuda/nvrtc_compiler.h"
#include "codegen/cuda/loaded_program.h"

namespace kiln::codegen::cuda {

struct CudaProgram {
  std::shared_ptr<LoadedProgram> loaded;
  std::string arch;  ///< what NVRTC compiled for: sm_XY, or compute_XY when only PTX fits the device
  NvrtcVersion nvrtc_version;
  double compile_ms = 0;
};

/// `source` compiled for device `ordinal` (its compute capability read through the driver; the device
/// helper headers available to #include) and loaded into its primary context. Thread-safe; the first call
/// per (device, source, line_info) compiles, later ones return the same program. Compile errors throw
/// kiln::Error quoting the failing line (nvrtc_compiler.h); nothing is cached for them.
CudaProgram cuda_program_for_device(int ordinal, const std::string& source, const std::string& program_name,
                                    bool line_info = false);

/// Several programs for one device at once: the ones neither cache holds are compiled side by side (threads up
/// to the machine's cores, each handing its program to an NVRTC worker process: compile_cuda_parts), then
/// loaded. Same guarantees and errors as above.
std::vector<CudaProgram> cuda_programs_for_device(int ordinal, const std::vector<std::string>& sources,
                                                  const std::string& program_name, bool line_info = false);

/// The parts of one source compiled side by side as cuda_programs_for_device does (with more than one part, in
/// NVRTC worker processes where they start, nvrtc_workers.h), without the caches and without a device: for
/// tests and tools. Errors as compile_cuda's.
std::vector<CompiledCuda> compile_cuda_parts(const std::vector<std::string>& sources, const std::string& program_name,
                                             const NvrtcOptions& options);

/// How many programs were compiled and how many requests the memory cache answered.
struct CudaProgramCacheStats {
  long compiled = 0;     // NVRTC runs
  long disk_hits = 0;    // images read from the disk cache instead
  long memory_hits = 0;
};
CudaProgramCacheStats cuda_program_cache_stats();

}  // namespace kiln::codegen::cuda
