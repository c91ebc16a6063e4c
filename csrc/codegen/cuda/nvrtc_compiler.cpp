// NVRTC wrapper. kiln declares NVRTC's handful of C entry points itself (no nvrtc.h at build time) and opens
// the library once per process; a failed search is remembered with every path tried, so the error says
// what to install. Compiles run without the GIL: NVRTC is thread-safe across programs.
#include "codegen/cuda/nvrtc_compiler.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <set>
#include <sstream>

#include "common/dynamic_library.h"
#include "common/error.h"
#include "codegen/cuda/nvrtc_api.h"
#include "codegen/cuda/nvrtc_workers.h"
#include "common/log.h"

namespace kiln::codegen::cuda {
namespace {

using NvrtcApi = nvrtc::Api;

struct LoadedNvrtc {
  NvrtcApi api{};
  bool ok = false;
  std::string path;
  NvrtcVersion version;
  std::vector<int> archs;
  std::string failure;
};

// Where the embedding interpreter finds the `nvidia` wheel's lib folders (bindings/ sets it: importlib); unset in
// programs without Python and in the C++ tests, which then search the other places only.
std::vector<std::string> (*g_wheel_dirs)() = nullptr;

std::vector<std::string> nvrtc_wheel_dirs() { return g_wheel_dirs ? g_wheel_dirs() : std::vector<std::string>{}; }

// libnvrtc files in a folder, best first: the unversioned link, then versioned sonames (newest first).
// libnvrtc-builtins and the .alt variants are NVRTC's own helpers, not entry points.
std::vector<std::string> nvrtc_files_in(const std::string& dir) {
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::string name = entry.path().filename().string();
    if (name.rfind("libnvrtc.so", 0) == 0) files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end(), [](const std::string& a, const std::string& b) {
    return a.size() != b.size() ? a.size() < b.size() : a > b;
  });
  return files;
}

std::vector<std::string> nvrtc_candidates() {
  std::vector<std::string> candidates;
  if (const char* override_path = std::getenv("KILN_NVRTC_PATH"); override_path && *override_path) {
    if (std::filesystem::is_directory(override_path)) {
      for (auto& f : nvrtc_files_in(override_path)) candidates.push_back(f);
      if (candidates.empty()) candidates.push_back(std::string(override_path) + "/libnvrtc.so");
    } else {
      candidates.push_back(override_path);
    }
  }
  for (auto& f : nvrtc_files_in("/usr/local/cuda/lib64")) candidates.push_back(f);
  for (const auto& dir : nvrtc_wheel_dirs())
    for (auto& f : nvrtc_files_in(dir)) candidates.push_back(f);
  for (const char* soname : {"libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"}) candidates.push_back(soname);
  return candidates;
}

// The file a handle was opened from (a soname candidate resolves to wherever the loader found it).
std::string loaded_file_of(void* handle, const std::string& fallback) {
  Dl_info info{};
  void* symbol = dlsym(handle, "nvrtcVersion");
  if (symbol && dladdr(symbol, &info) && info.dli_fname) return info.dli_fname;
  return fallback;
}

LoadedNvrtc load_nvrtc() {
  LoadedNvrtc loaded;
  OpenedLibrary opened = open_first_library(nvrtc_candidates());
  void* handle = opened.handle;
  loaded.path = opened.path;
  if (!handle) {
    loaded.failure = "NVRTC (libnvrtc) was not found; tried:" + opened.tried +
                     "\nInstall it with `pip install nvidia-cuda-nvrtc` (scripts/setup.sh does on the development "
                     "machine), or set KILN_NVRTC_PATH to libnvrtc.so or its folder.";
    return loaded;
  }
  NvrtcApi& a = loaded.api;
  std::string missing;
  loaded.path = loaded_file_of(handle, loaded.path);
  nvrtc::preload_builtins_beside(loaded.path);
  missing = nvrtc::resolve_api(handle, a);
  if (!missing.empty()) {
    loaded.failure = "NVRTC at " + loaded.path + " lacks " + missing + ": kiln needs NVRTC 11.2 or newer";
    return loaded;
  }
  a.nvrtcVersion(&loaded.version.major, &loaded.version.minor);
  int count = 0;
  if (a.nvrtcGetNumSupportedArchs(&count) == 0 && count > 0) {
    loaded.archs.resize(count);
    if (a.nvrtcGetSupportedArchs(loaded.archs.data()) != 0) loaded.archs.clear();
  }
  loaded.ok = true;
  KILN_LOG(perf) << "NVRTC " << loaded.version.major << "." << loaded.version.minor << " loaded from " << loaded.path;
  return loaded;
}

const LoadedNvrtc& loaded_nvrtc() {
  static const LoadedNvrtc loaded = load_nvrtc();  // thread-safe, once per process
  return loaded;
}

const NvrtcApi& nvrtc() {
  const LoadedNvrtc& loaded = loaded_nvrtc();
  KILN_CHECK(loaded.ok) << loaded.failure;
  return loaded.api;
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// NVRTC reports errors as `<program>(<line>): error: ...`; quote each such line of the source once.
std::string quote_failing_lines(const std::string& log, const std::string& source, const std::string& program) {
  std::vector<std::string> source_lines = split_lines(source);
  std::set<int> quoted;
  std::ostringstream out;
  for (const auto& line : split_lines(log)) {
    size_t open = line.find('(');
    size_t close = line.find("): ", open == std::string::npos ? 0 : open);
    if (open == std::string::npos || close == std::string::npos || line.find("error", close) == std::string::npos)
      continue;
    // A file name that is not the program's is a header: its lines are not in `source`.
    if (line.compare(0, open, program) != 0) continue;
    int number = std::atoi(line.substr(open + 1, close - open - 1).c_str());
    if (number < 1 || number > static_cast<int>(source_lines.size()) || !quoted.insert(number).second) continue;
    out << "\n  " << program << ":" << number << " | " << source_lines[number - 1];
  }
  return out.str();
}

std::string numbered(const std::string& source) {
  std::ostringstream out;
  int number = 0;
  for (const auto& line : split_lines(source)) out << ++number << " | " << line << "\n";
  return out.str();
}

bool starts_with(const std::string& text, const char* prefix) { return text.rfind(prefix, 0) == 0; }

}  // namespace

void set_nvrtc_wheel_search(std::vector<std::string> (*wheel_dirs)()) { g_wheel_dirs = wheel_dirs; }

bool nvrtc_available() { return loaded_nvrtc().ok; }

NvrtcVersion nvrtc_version() {
  nvrtc();
  return loaded_nvrtc().version;
}

std::string nvrtc_library_path() { return loaded_nvrtc().ok ? loaded_nvrtc().path : std::string(); }

std::vector<int> nvrtc_supported_archs() {
  nvrtc();
  return loaded_nvrtc().archs;
}

std::string target_arch_for(int major, int minor) {
  int wanted = major * 10 + minor;
  const std::vector<int>& archs = nvrtc_supported_archs();
  if (archs.empty() || std::find(archs.begin(), archs.end(), wanted) != archs.end())
    return "sm_" + std::to_string(wanted);
  // SASS for one architecture does not run on a newer one, but PTX does (the driver compiles it).
  int newest_known = 0;
  for (int arch : archs)
    if (arch <= wanted) newest_known = std::max(newest_known, arch);
  KILN_CHECK(newest_known > 0) << "NVRTC " << loaded_nvrtc().path << " cannot compile for compute capability "
                               << major << "." << minor << " (it knows sm_" << archs.front() << " to sm_"
                               << archs.back() << "): install a matching nvidia-cuda-nvrtc";
  return "compute_" + std::to_string(newest_known);
}

namespace {

// nvrtcCreateProgram .. nvrtcGetCUBIN in this process.
nvrtc_worker::Response compile_here(const nvrtc_worker::Request& request) {
  nvrtc_worker::Response response = nvrtc::compile_with(nvrtc(), request);
  KILN_ASSERT(response.nvrtc_result != -1) << response.error;
  return response;
}

}  // namespace

CompiledCuda compile_cuda(const std::string& source, const std::string& program_name, const NvrtcOptions& options,
                          bool in_worker) {
  nvrtc();  // a missing NVRTC is reported here, wherever the program would have compiled
  KILN_CHECK(starts_with(options.arch, "sm_") || starts_with(options.arch, "compute_"))
      << "CUDA architecture '" << options.arch << "' is not one NVRTC takes: write sm_90 (cubin) or compute_90 (PTX)";
  nvrtc_worker::Request request;
  request.nvrtc_path = loaded_nvrtc().path;
  request.program_name = program_name;
  request.source = source;
  request.flags = {"--gpu-architecture=" + options.arch, "-default-device", "--std=c++17"};
  if (options.line_info) request.flags.push_back("-lineinfo");
  request.flags.insert(request.flags.end(), options.extra_flags.begin(), options.extra_flags.end());
  for (const auto& header : options.headers) request.headers.emplace_back(header.name, header.content);
  request.cubin = starts_with(options.arch, "sm_");

  CompiledCuda result;
  std::optional<nvrtc_worker::Response> response;
  if (in_worker) {
    response = compile_in_worker(request);
    if (response && response->nvrtc_result == -1) {  // the worker could not run NVRTC: this process can
      KILN_LOG(perf) << "NVRTC worker could not compile '" << program_name << "' (" << response->error
                     << "); compiling it in this process";
      response.reset();
    }
    result.in_worker = response.has_value();
  }
  if (!response) response = compile_here(request);
  result.compile_ms = response->compile_ms;
  result.log = response->log;
  if (response->nvrtc_result != 0) {
    KILN_LOG(output_code) << "CUDA program '" << program_name << "' that NVRTC rejected:\n" << numbered(source);
    std::string quoted = quote_failing_lines(result.log, source, program_name);
    KILN_CHECK(false) << "NVRTC " << loaded_nvrtc().version.major << "." << loaded_nvrtc().version.minor
                      << " could not compile CUDA program '" << program_name << "' for " << options.arch << " ("
                      << response->error << "):\n"
                      << result.log << (quoted.empty() ? "" : "failing source lines:") << quoted
                      << "\n(KILN_LOGS=output_code prints the whole numbered source)";
  }
  result.arch = options.arch;
  result.is_cubin = request.cubin;
  result.version = loaded_nvrtc().version;
  result.image = std::move(response->image);
  if (!result.log.empty()) KILN_LOG(output_code) << "NVRTC warnings for '" << program_name << "':\n" << result.log;
  KILN_LOG(perf) << "NVRTC compiled '" << program_name << "' for " << options.arch << " in " << result.compile_ms
                 << " ms" << (result.in_worker ? " (worker process)" : "");
  return result;
}

}  // namespace kiln::codegen::cuda
