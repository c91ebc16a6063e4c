// Program cache for CUDA: compile once per (device, flags, source), load once into the device's primary
// context. Entries live for the process (loaded modules are never unloaded, see loaded_program.h). Below the
// memory cache, compiled images live on disk (cache/kernel_cache.h, kind "cuda"), keyed by the SHA-256 of the
// source, the device helpers, NVRTC's version, the flags and the architecture: a new process loads them without
// NVRTC.
#include "codegen/cuda/cuda_program_cache.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cache/cache_journal.h"
#include "cache/kernel_cache.h"
#include "codegen/cuda/cuda_device_lib.h"
#include "common/error.h"
#include "common/log.h"
#include "common/progress.h"

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

// The compiled image of `source` for `options`: from the disk cache, or compiled by NVRTC and published.
CompiledCuda compile_or_load(const std::string& source, const std::string& program_name, const NvrtcOptions& options,
                             CudaProgramCacheStats& stats, bool in_worker) {
  const NvrtcVersion version = nvrtc_version();
  std::string identity = source + "\n//nvrtc " + std::to_string(version.major) + "." + std::to_string(version.minor) +
                         "|" + options.arch + "|" + (options.line_info ? "-lineinfo" : "") + "|";
  for (const CudaHeader& h : options.headers) identity += h.name + "\x1f" + h.content + "\x1f";
  identity += "|" + std::to_string(cache::kSchemaVersion);
  const std::optional<std::string> key = cache::entry_key(identity);  // nullopt without libcrypto: no disk cache
  const bool cubin = options.arch.rfind("sm_", 0) == 0;
  const std::string suffix = cubin ? ".cubin" : ".ptx";
  // read_entry checks the file and its directory before the image is loaded into the driver.
  if (std::optional<std::string> image = key ? cache::read_entry("cuda", *key, suffix) : std::nullopt;
      image && !image->empty()) {
    CompiledCuda loaded;
    loaded.image = std::move(*image);
    loaded.is_cubin = cubin;
    loaded.arch = options.arch;
    loaded.version = version;
    ++stats.disk_hits;
    return loaded;
  }
  CompiledCuda compiled = compile_cuda(source, program_name, options, in_worker);
  ++stats.compiled;
  try {
    if (key) cache::publish_content("cuda", *key, suffix, compiled.image);
  } catch (const std::exception& e) {
    KILN_LOG(perf) << "CUDA program '" << program_name << "' not written to the disk cache: " << e.what();
  }
  return compiled;
}

// Runs fn(0) .. fn(n - 1) on up to one thread per core; the first error is rethrown once all have finished.
void run_in_parallel(size_t n, const std::function<void(size_t)>& fn) {
  std::vector<std::exception_ptr> errors(n);
  auto run_one = [&](size_t i) {
    try {
      fn(i);
    } catch (...) {
      errors[i] = std::current_exception();
    }
  };
  const size_t workers = std::min<size_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  if (workers <= 1) {
    for (size_t i = 0; i < n; ++i) run_one(i);
  } else {
    std::atomic<size_t> next{0};
    std::vector<std::thread> threads;
    for (size_t w = 0; w < workers; ++w)
      threads.emplace_back([&] {
        for (size_t i = next++; i < n; i = next++) run_one(i);
      });
    for (auto& t : threads) t.join();
  }
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace

std::vector<CompiledCuda> compile_cuda_parts(const std::vector<std::string>& sources, const std::string& program_name,
                                             const NvrtcOptions& options) {
  std::vector<CompiledCuda> compiled(sources.size());
  run_in_parallel(sources.size(), [&](size_t i) {
    compiled[i] = compile_cuda(sources[i], program_name, options, /*in_worker=*/sources.size() > 1);
  });
  return compiled;
}

std::vector<CudaProgram> cuda_programs_for_device(int ordinal, const std::vector<std::string>& sources,
                                                  const std::string& program_name, bool line_info) {
  ProgramCache& c = cache();
  std::vector<CudaProgram> programs(sources.size());
  std::vector<size_t> missing;
  NvrtcOptions options;
  // While kiln.export's save records the cache entries a compile uses, programs loaded already are read from the disk
  // cache again so that their images are recorded (cache/cache_journal.h).
  const bool journal = cache::journal_open();
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    for (size_t i = 0; i < sources.size(); ++i) {
      auto found = c.programs.find(cache_key(ordinal, line_info, sources[i]));
      if (found != c.programs.end() && !journal) {
        ++c.stats.memory_hits;
        programs[i] = found->second;
      } else {
        missing.push_back(i);
      }
    }
    if (missing.empty()) return programs;
    auto arch = c.arch_of_device.find(ordinal);
    if (arch == c.arch_of_device.end()) {
      ComputeCapability cc = compute_capability(ordinal);
      arch = c.arch_of_device.emplace(ordinal, target_arch_for(cc.major, cc.minor)).first;
    }
    options.arch = arch->second;
  }
  options.line_info = line_info;
  options.headers = cuda_device_headers();
  // The parts compile side by side: on threads, each handing its program to an NVRTC worker process
  // (nvrtc_workers.h; NVRTC may compile one program at a time per process). The lock is not held meanwhile (two
  // threads asking for the same source may both compile it: the first to finish is kept).
  std::vector<CompiledCuda> compiled(missing.size());
  std::vector<CudaProgramCacheStats> stats(missing.size());
  progress::stage("compile CUDA (NVRTC, " + std::to_string(missing.size()) + (missing.size() > 1 ? " programs)" : " program)"));
  run_in_parallel(missing.size(), [&](size_t m) {
    compiled[m] = compile_or_load(sources[missing[m]], program_name, options, stats[m], /*in_worker=*/missing.size() > 1);
  });
  progress::stage("load");
  std::lock_guard<std::mutex> lock(c.mutex);
  for (size_t m = 0; m < missing.size(); ++m) {
    c.stats.compiled += stats[m].compiled;
    c.stats.disk_hits += stats[m].disk_hits;
    std::string key = cache_key(ordinal, line_info, sources[missing[m]]);
    auto found = c.programs.find(key);
    if (found == c.programs.end()) {
      CudaProgram program;
      program.loaded = std::make_shared<LoadedProgram>(ordinal, compiled[m].image);
      program.arch = compiled[m].arch;
      program.nvrtc_version = compiled[m].version;
      program.compile_ms = compiled[m].compile_ms;
      KILN_LOG(perf) << "CUDA program '" << program_name << "' (" << m + 1 << " of " << missing.size()
                     << " compiled) loaded on device " << ordinal << " (" << program.arch << ", NVRTC "
                     << compiled[m].compile_ms << " ms)";
      found = c.programs.emplace(std::move(key), std::move(program)).first;
    }
    programs[missing[m]] = found->second;
  }
  return programs;
}

CudaProgram cuda_program_for_device(int ordinal, const std::string& source, const std::string& program_name,
                                    bool line_info) {
  return cuda_programs_for_device(ordinal, {source}, program_name, line_info)[0];
}

CudaProgramCacheStats cuda_program_cache_stats() {
  std::lock_guard<std::mutex> lock(cache().mutex);
  return cache().stats;
}

}  // namespace kiln::codegen::cuda
