#include "codegen/cpp/cpp_backend.h"

#include <mutex>

#include "codegen/cpp/compile_cpp.h"
#include "codegen/cpp/emit_cpp.h"
#include "common/error.h"

namespace kiln::codegen::cpp {

namespace {

using KernelFn = void (*)(void* const*);
using SizedKernelFn = void (*)(void* const*, const int64_t*);  // with size arguments (codegen/size_arguments.h)

// Held while a kernel with gathered loads runs and its library's index-error flag is read: the flag is the
// library's, and two threads running such kernels at once (the runtime releases the GIL) would read each other's.
std::mutex g_gathering_kernels;

class CppKernel final : public LoadedKernel {
 public:
  // `sized`: the function takes size arguments, `sizes` (the entry's).
  CppKernel(void* fn, bool sized, std::vector<int64_t> sizes, int* index_error)
      : fn_(fn), sized_(sized), sizes_(std::move(sizes)), index_error_(index_error) {}
  bool run(void* const* buffers, size_t, void*) const override {
    if (!index_error_) {
      call(buffers);
      return true;
    }
    std::lock_guard<std::mutex> lock(g_gathering_kernels);
    call(buffers);
    const bool in_range = *index_error_ == 0;
    *index_error_ = 0;
    return in_range;
  }

 private:
  void call(void* const* buffers) const {
    if (sized_) reinterpret_cast<SizedKernelFn>(fn_)(buffers, sizes_.data());
    else reinterpret_cast<KernelFn>(fn_)(buffers);
  }
  void* fn_;
  bool sized_;
  std::vector<int64_t> sizes_;
  int* index_error_;  // the library's kiln_index_error (device_lib/cpp_prelude.h), for kernels with gathered loads
};

class CppCode final : public LoadedCode {
 public:
  CppCode(std::shared_ptr<SharedLibrary> library, bool size_arguments)
      : library_(std::move(library)), size_arguments_(size_arguments) {}
  std::unique_ptr<LoadedKernel> kernel(const cache::KernelEntry& entry, bool gathers) const override {
    void* fn = library_->symbol(entry.name);
    int* index_error = gathers ? static_cast<int*>(library_->symbol("kiln_index_error")) : nullptr;
    return std::make_unique<CppKernel>(fn, size_arguments_, entry.sizes, index_error);
  }

 private:
  std::shared_ptr<SharedLibrary> library_;
  bool size_arguments_;
};

class CppBackend final : public DeviceBackend {
 public:
  const char* name() const override { return "cpp"; }

  // `tune`: the C++ kernels have no alternatives to time.
  cache::DeviceCode emit(fusion::Schedule& schedule, const graph::Graph& g, bool, bool size_arguments,
                         bool /*tune*/) const override {
    CppSource source = emit_cpp_source(schedule, g, size_arguments);
    cache::DeviceCode code;
    code.backend = name();
    code.parts = {std::move(source.text)};
    code.size_arguments = size_arguments;
    for (size_t k = 0; k < source.functions.size(); ++k) {
      cache::KernelEntry entry;
      entry.name = std::move(source.functions[k]);
      entry.sizes = std::move(source.sizes[k]);
      code.kernels.push_back(std::move(entry));
    }
    return code;
  }

  std::shared_ptr<const LoadedCode> load(const cache::DeviceCode& code, int, const std::string& context) const override {
    KILN_ASSERT_EQ(code.parts.size(), 1u) << "translation units of a CPU graph";
    return std::make_shared<CppCode>(compile_cpp_library(code.parts[0], context), code.size_arguments);
  }
};

}  // namespace

const DeviceBackend& cpp_backend() {
  static const CppBackend backend;
  return backend;
}

}  // namespace kiln::codegen::cpp
