// In-memory program cache for CUDA: compile once per (device, flags, source), load once into the device's
// primary context. Entries live for the process (loaded modules are never unloaded, see cuda_launch.h).
#include "codegen/cuda/cuda_program_cache.h"

#include <mutex>
#include <unordered_map>

#include "codegen/cuda/cuda_device_lib.h"
#include "common/error.h"
#include "common/log.h"

namespace kiln::codegen::cuda {
namespace {

struct ProgramCache {
  std::mutex mutex;
  std::unordered_map<std::string, CudaProgram> programs;  // key: device, flags and the full source
  std::unordered_map<int, std::string> arch_of_device;
  CudaProgramCacheStats stats;
};

ProgramCache& cache() {
  static ProgramCache* instance = new ProgramCache();  // never destroyed: modules outlive interpreter teardown
  return *instance;
}

// The full source is part of the key, so two programs can never share an entry by a hash collision.
std::string cache_key(int ordinal, bool line_info, const std::string& source) {
  std::string key = std::to_string(ordinal);
  key += line_info ? "\x1f-lineinfo\x1f" : "\x1f\x1f";
  key += source;
  return key;
}

}  // namespace

CudaProgram cuda_program_for_device(int ordinal, const std::string& source, const std::string& program_name,
                                    bool line_info) {
  ProgramCache& c = cache();
  std::string key = cache_key(ordinal, line_info, source);
  std::lock_guard<std::mutex> lock(c.mutex);
  auto found = c.programs.find(key);
  if (found != c.programs.end()) {
    ++c.stats.memory_hits;
    return found->second;
  }
  auto arch = c.arch_of_device.find(ordinal);
  if (arch == c.arch_of_device.end()) {
    runtime::cuda::ComputeCapability cc = runtime::cuda::compute_capability(ordinal);
    arch = c.arch_of_device.emplace(ordinal, target_arch_for(cc.major, cc.minor)).first;
  }
  NvrtcOptions options;
  options.arch = arch->second;
  options.line_info = line_info;
  options.headers = cuda_device_headers();
  CompiledCuda compiled = compile_cuda(source, program_name, options);
  CudaProgram program;
  program.loaded = std::make_shared<runtime::cuda::LoadedProgram>(ordinal, compiled.image);
  program.arch = compiled.arch;
  program.nvrtc_version = compiled.version;
  program.compile_ms = compiled.compile_ms;
  ++c.stats.compiled;
  KILN_LOG(perf) << "CUDA program '" << program_name << "' loaded on device " << ordinal << " (" << program.arch
                 << ", NVRTC " << compiled.compile_ms << " ms)";
  return c.programs.emplace(std::move(key), std::move(program)).first->second;
}

CudaProgramCacheStats cuda_program_cache_stats() {
  std::lock_guard<std::mutex> lock(cache().mutex);
  return cache().stats;
}

}  // namespace kiln::codegen::cuda
