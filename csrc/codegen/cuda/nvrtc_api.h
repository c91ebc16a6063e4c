#pragma once
// NVRTC's C entry points as kiln uses them, shared by kiln (nvrtc_compiler.cpp) and its worker process
// (csrc/tools/nvrtc_worker.cpp): declared here (no nvrtc.h at build time), resolved from a dlopen handle.
// Header-only and free of kiln's other code, which the worker does not link.
#include <dlfcn.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "codegen/cuda/nvrtc_worker_protocol.h"

namespace kiln::nvrtc {

using Result = int;  // nvrtcResult; 0 is NVRTC_SUCCESS
using Program = struct ProgramOpaque*;

struct Api {
  Result (*nvrtcVersion)(int* major, int* minor) = nullptr;
  const char* (*nvrtcGetErrorString)(Result result) = nullptr;
  Result (*nvrtcGetNumSupportedArchs)(int* count) = nullptr;
  Result (*nvrtcGetSupportedArchs)(int* archs) = nullptr;
  Result (*nvrtcCreateProgram)(Program* program, const char* source, const char* name, int header_count,
                               const char* const* headers, const char* const* include_names) = nullptr;
  Result (*nvrtcDestroyProgram)(Program* program) = nullptr;
  Result (*nvrtcCompileProgram)(Program program, int option_count, const char* const* options) = nullptr;
  Result (*nvrtcGetPTXSize)(Program program, size_t* size) = nullptr;
  Result (*nvrtcGetPTX)(Program program, char* ptx) = nullptr;
  Result (*nvrtcGetCUBINSize)(Program program, size_t* size) = nullptr;
  Result (*nvrtcGetCUBIN)(Program program, char* cubin) = nullptr;
  Result (*nvrtcGetProgramLogSize)(Program program, size_t* size) = nullptr;
  Result (*nvrtcGetProgramLog)(Program program, char* log) = nullptr;
};

/// Fills `a` from an open libnvrtc; returns the names of missing entry points ("" when all were found).
inline std::string resolve_api(void* handle, Api& a) {
  std::string missing;
  auto resolve = [&](const char* name, auto& slot) {
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(dlsym(handle, name));
    if (!slot) missing += std::string(missing.empty() ? "" : ", ") + name;
  };
  resolve("nvrtcVersion", a.nvrtcVersion);
  resolve("nvrtcGetErrorString", a.nvrtcGetErrorString);
  resolve("nvrtcGetNumSupportedArchs", a.nvrtcGetNumSupportedArchs);
  resolve("nvrtcGetSupportedArchs", a.nvrtcGetSupportedArchs);
  resolve("nvrtcCreateProgram", a.nvrtcCreateProgram);
  resolve("nvrtcDestroyProgram", a.nvrtcDestroyProgram);
  resolve("nvrtcCompileProgram", a.nvrtcCompileProgram);
  resolve("nvrtcGetPTXSize", a.nvrtcGetPTXSize);
  resolve("nvrtcGetPTX", a.nvrtcGetPTX);
  resolve("nvrtcGetCUBINSize", a.nvrtcGetCUBINSize);
  resolve("nvrtcGetCUBIN", a.nvrtcGetCUBIN);
  resolve("nvrtcGetProgramLogSize", a.nvrtcGetProgramLogSize);
  resolve("nvrtcGetProgramLog", a.nvrtcGetProgramLog);
  return missing;
}

/// libnvrtc opens its helper library libnvrtc-builtins.so.X.Y by soname when it first compiles, which fails
/// for a folder outside the loader's path (the pip wheel's): loading it first from the same folder makes
/// that lookup find the copy already in the process. Kept open for the process, like libnvrtc.
inline void preload_builtins_beside(const std::string& nvrtc_file) {
  std::string dir = std::filesystem::path(nvrtc_file).parent_path().string();
  if (dir.empty()) return;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::string name = entry.path().filename().string();
    if (name.rfind("libnvrtc-builtins.so", 0) == 0 && name.find(".alt.") == std::string::npos)
      dlopen(entry.path().c_str(), RTLD_NOW | RTLD_LOCAL);
  }
}

/// One program through nvrtcCreateProgram .. nvrtcGetCUBIN/PTX. nvrtc_result is NVRTC's (error set from it),
/// or -1 when it succeeded but gave no image. PTX comes without its terminating NUL.
inline nvrtc_worker::Response compile_with(const Api& a, const nvrtc_worker::Request& request) {
  std::vector<const char*> names, contents, flags;
  for (const auto& [name, content] : request.headers) {
    names.push_back(name.c_str());
    contents.push_back(content.c_str());
  }
  for (const auto& flag : request.flags) flags.push_back(flag.c_str());
  nvrtc_worker::Response response;
  Program program = nullptr;
  response.nvrtc_result = a.nvrtcCreateProgram(&program, request.source.c_str(), request.program_name.c_str(),
                                               static_cast<int>(names.size()), contents.data(), names.data());
  if (response.nvrtc_result != 0) {
    response.error = std::string("nvrtcCreateProgram: ") + a.nvrtcGetErrorString(response.nvrtc_result);
    return response;
  }
  auto start = std::chrono::steady_clock::now();
  response.nvrtc_result = a.nvrtcCompileProgram(program, static_cast<int>(flags.size()), flags.data());
  response.compile_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (response.nvrtc_result != 0) response.error = a.nvrtcGetErrorString(response.nvrtc_result);
  size_t size = 0;
  if (a.nvrtcGetProgramLogSize(program, &size) == 0 && size > 1) {
    response.log.resize(size);
    response.log.resize(a.nvrtcGetProgramLog(program, response.log.data()) == 0 ? size - 1 : 0);
  }
  if (response.nvrtc_result == 0) {
    size = 0;
    const bool sized = (request.cubin ? a.nvrtcGetCUBINSize(program, &size) : a.nvrtcGetPTXSize(program, &size)) == 0;
    response.image.resize(size);
    const bool copied = sized && size > 0 &&
                        (request.cubin ? a.nvrtcGetCUBIN(program, response.image.data())
                                       : a.nvrtcGetPTX(program, response.image.data())) == 0;
    if (!copied) {
      response.nvrtc_result = -1;
      response.error = request.cubin ? "NVRTC produced no cubin" : "NVRTC produced no PTX";
      response.image.clear();
    } else if (!request.cubin) {
      response.image.resize(size - 1);
    }
  }
  a.nvrtcDestroyProgram(&program);
  return response;
}

}  // namespace kiln::nvrtc
