#pragma once
/// C++ source -> loaded shared library, through the on-disk cache (cache/kernel_cache.h).
///
/// Needs: a self-contained translation unit. Guarantees: a source compiled once (in this process or any
/// earlier one with the same compiler, flags, torch version and schema) is loaded without running the
/// compiler; failures (no compiler, compile errors, dlopen errors) throw kiln::Error with the compiler's
/// output, and the caller falls back.
#include <memory>
#include <string>

namespace kiln::codegen::cpp {

class SharedLibrary {
 public:
  explicit SharedLibrary(void* handle, std::string path) : handle_(handle), path_(std::move(path)) {}
  /// Never unloaded: kernels may run until the process exits, and unloading OpenMP code is fragile.
  ~SharedLibrary() = default;
  /// The address of an `extern "C"` function; throws if missing.
  void* symbol(const std::string& name) const;
  const std::string& path() const { return path_; }

 private:
  void* handle_;
  std::string path_;
};

/// `extra_key` names whatever else the artefact depends on (the torch version).
std::shared_ptr<SharedLibrary> compile_cpp_library(const std::string& source, const std::string& extra_key);

/// The compiler command ($CXX or `c++`) and flags used.
std::string cpp_compiler();
std::string cpp_flags();

}  // namespace kiln::codegen::cpp
