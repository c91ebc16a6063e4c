// NVRTC wrapper. kiln declares NVRTC's handful of C entry points itself (no nvrtc.h at build time) and opens
// the library once per process; a failed search is remembered with every path tried, so the error says
// what to install. Compiles run without the GIL: NVRTC is thread-safe across programs.
#include "codegen/cuda/nvrtc_compiler.h"

#include <Python.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <sstream>

#include "common/dynamic_library.h"
#include "common/error.h"
#include "common/log.h"

namespace kiln::codegen::cuda {
namespace {

using NvrtcResult = int;  // nvrtcResult; 0 is NVRTC_SUCCESS
using NvrtcProgram = struct NvrtcProgramOpaque*;

struct NvrtcApi {
  NvrtcResult (*nvrtcVersion)(int* major, int* minor);
  const char* (*nvrtcGetErrorString)(NvrtcResult result);
  NvrtcResult (*nvrtcGetNumSupportedArchs)(int* count);
  NvrtcResult (*nvrtcGetSupportedArchs)(int* archs);
  NvrtcResult (*nvrtcCreateProgram)(NvrtcProgram* program, const char* source, const char* name, int header_count,
                                    const char* const* headers, const char* const* include_names);
  NvrtcResult (*nvrtcDestroyProgram)(NvrtcProgram* program);
  NvrtcResult (*nvrtcCompileProgram)(NvrtcProgram program, int option_count, const char* const* options);
  NvrtcResult (*nvrtcGetPTXSize)(NvrtcProgram program, size_t* size);
  NvrtcResult (*nvrtcGetPTX)(NvrtcProgram program, char* ptx);
  NvrtcResult (*nvrtcGetCUBINSize)(NvrtcProgram program, size_t* size);
  NvrtcResult (*nvrtcGetCUBIN)(NvrtcProgram program, char* cubin);
  NvrtcResult (*nvrtcGetProgramLogSize)(NvrtcProgram program, size_t* size);
  NvrtcResult (*nvrtcGetProgramLog)(NvrtcProgram program, char* log);
};

struct LoadedNvrtc {
  NvrtcApi api{};
  bool ok = false;
  std::string path;
  NvrtcVersion version;
  std::vector<int> archs;
  std::string failure;
};

// The wheel's lib folders, from `importlib.util.find_spec("nvidia").submodule_search_locations`. Empty when
// Python is not running (C++ tests) or the package is absent.
std::vector<std::string> nvrtc_wheel_dirs() {
  std::vector<std::string> dirs;
  if (!Py_IsInitialized()) return dirs;
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* util = PyImport_ImportModule("importlib.util");
  PyObject* spec = util ? PyObject_CallMethod(util, "find_spec", "s", "nvidia") : nullptr;
  PyObject* locations =
      (spec && spec != Py_None) ? PyObject_GetAttrString(spec, "submodule_search_locations") : nullptr;
  PyObject* iterator = (locations && locations != Py_None) ? PyObject_GetIter(locations) : nullptr;
  while (PyObject* item = iterator ? PyIter_Next(iterator) : nullptr) {
    if (const char* text = PyUnicode_Check(item) ? PyUnicode_AsUTF8(item) : nullptr) {
      for (const char* sub : {"cu13/lib", "cuda_nvrtc/lib", "cu12/lib"}) dirs.push_back(std::string(text) + "/" + sub);
    }
    Py_DECREF(item);
  }
  Py_XDECREF(iterator);
  Py_XDECREF(locations);
  Py_XDECREF(spec);
  Py_XDECREF(util);
  PyErr_Clear();  // a missing package is an ordinary outcome of the search
  PyGILState_Release(gil);
  return dirs;
}

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

// libnvrtc opens its helper library libnvrtc-builtins.so.X.Y by soname when it first compiles, which fails
// for a folder outside the loader's path (the pip wheel's): loading it first from the same folder makes
// that lookup find the copy already in the process.
void preload_builtins_beside(const std::string& nvrtc_file) {
  std::string dir = std::filesystem::path(nvrtc_file).parent_path().string();
  if (dir.empty()) return;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::string name = entry.path().filename().string();
    if (name.rfind("libnvrtc-builtins.so", 0) == 0 && name.find(".alt.") == std::string::npos)
      dlopen(entry.path().c_str(), RTLD_NOW | RTLD_LOCAL);  // kept open for the process, like libnvrtc
  }
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
  preload_builtins_beside(loaded.path);
  resolve_symbol(handle, "nvrtcVersion", a.nvrtcVersion, missing);
  resolve_symbol(handle, "nvrtcGetErrorString", a.nvrtcGetErrorString, missing);
  resolve_symbol(handle, "nvrtcGetNumSupportedArchs", a.nvrtcGetNumSupportedArchs, missing);
  resolve_symbol(handle, "nvrtcGetSupportedArchs", a.nvrtcGetSupportedArchs, missing);
  resolve_symbol(handle, "nvrtcCreateProgram", a.nvrtcCreateProgram, missing);
  resolve_symbol(handle, "nvrtcDestroyProgram", a.nvrtcDestroyProgram, missing);
  resolve_symbol(handle, "nvrtcCompileProgram", a.nvrtcCompileProgram, missing);
  resolve_symbol(handle, "nvrtcGetPTXSize", a.nvrtcGetPTXSize, missing);
  resolve_symbol(handle, "nvrtcGetPTX", a.nvrtcGetPTX, missing);
  resolve_symbol(handle, "nvrtcGetCUBINSize", a.nvrtcGetCUBINSize, missing);
  resolve_symbol(handle, "nvrtcGetCUBIN", a.nvrtcGetCUBIN, missing);
  resolve_symbol(handle, "nvrtcGetProgramLogSize", a.nvrtcGetProgramLogSize, missing);
  resolve_symbol(handle, "nvrtcGetProgramLog", a.nvrtcGetProgramLog, missing);
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

// Destroys the program on every path out of compile_cuda, the throwing ones included.
struct ProgramOwner {
  NvrtcProgram program = nullptr;
  ~ProgramOwner() {
    if (program) loaded_nvrtc().api.nvrtcDestroyProgram(&program);
  }
};

std::string program_log(const NvrtcApi& a, NvrtcProgram program) {
  size_t size = 0;
  if (a.nvrtcGetProgramLogSize(program, &size) != 0 || size <= 1) return "";
  std::string log(size, '\0');
  if (a.nvrtcGetProgramLog(program, log.data()) != 0) return "";
  log.resize(size - 1);  // the size counts the terminating NUL
  return log;
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

CompiledCuda compile_cuda(const std::string& source, const std::string& program_name, const NvrtcOptions& options) {
  const NvrtcApi& a = nvrtc();
  KILN_CHECK(starts_with(options.arch, "sm_") || starts_with(options.arch, "compute_"))
      << "CUDA architecture '" << options.arch << "' is not one NVRTC takes: write sm_90 (cubin) or compute_90 (PTX)";
  std::vector<const char*> header_texts, header_names;
  for (const auto& header : options.headers) {
    header_texts.push_back(header.content.c_str());
    header_names.push_back(header.name.c_str());
  }
  ProgramOwner owner;
  NvrtcResult created =
      a.nvrtcCreateProgram(&owner.program, source.c_str(), program_name.c_str(), static_cast<int>(header_texts.size()),
                           header_texts.data(), header_names.data());
  KILN_CHECK(created == 0) << "nvrtcCreateProgram failed for '" << program_name
                           << "': " << a.nvrtcGetErrorString(created);

  std::vector<std::string> flags = {"--gpu-architecture=" + options.arch, "-default-device", "--std=c++17"};
  if (options.line_info) flags.push_back("-lineinfo");
  flags.insert(flags.end(), options.extra_flags.begin(), options.extra_flags.end());
  std::vector<const char*> flag_pointers;
  for (const auto& flag : flags) flag_pointers.push_back(flag.c_str());

  auto start = std::chrono::steady_clock::now();
  NvrtcResult compiled =
      a.nvrtcCompileProgram(owner.program, static_cast<int>(flag_pointers.size()), flag_pointers.data());
  CompiledCuda result;
  result.compile_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  result.log = program_log(a, owner.program);
  if (compiled != 0) {
    KILN_LOG(output_code) << "CUDA program '" << program_name << "' that NVRTC rejected:\n" << numbered(source);
    std::string quoted = quote_failing_lines(result.log, source, program_name);
    KILN_CHECK(false) << "NVRTC " << loaded_nvrtc().version.major << "." << loaded_nvrtc().version.minor
                      << " could not compile CUDA program '" << program_name << "' for " << options.arch << " ("
                      << a.nvrtcGetErrorString(compiled) << "):\n"
                      << result.log << (quoted.empty() ? "" : "failing source lines:") << quoted
                      << "\n(KILN_LOGS=output_code prints the whole numbered source)";
  }
  result.arch = options.arch;
  result.is_cubin = starts_with(options.arch, "sm_");
  result.version = loaded_nvrtc().version;
  size_t size = 0;
  if (result.is_cubin) {
    KILN_ASSERT(a.nvrtcGetCUBINSize(owner.program, &size) == 0 && size > 0) << "NVRTC produced no cubin";
    result.image.resize(size);
    KILN_ASSERT(a.nvrtcGetCUBIN(owner.program, result.image.data()) == 0) << "nvrtcGetCUBIN failed";
  } else {
    KILN_ASSERT(a.nvrtcGetPTXSize(owner.program, &size) == 0 && size > 0) << "NVRTC produced no PTX";
    result.image.resize(size);
    KILN_ASSERT(a.nvrtcGetPTX(owner.program, result.image.data()) == 0) << "nvrtcGetPTX failed";
    result.image.resize(size - 1);  // PTX is text: drop the NUL the size counts (std::string keeps its own)
  }
  if (!result.log.empty()) KILN_LOG(output_code) << "NVRTC warnings for '" << program_name << "':\n" << result.log;
  KILN_LOG(perf) << "NVRTC compiled '" << program_name << "' for " << options.arch << " in " << result.compile_ms
                 << " ms";
  return result;
}

}  // namespace kiln::codegen::cuda
