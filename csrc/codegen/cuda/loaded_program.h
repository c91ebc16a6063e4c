#pragma once
// Compiled CUDA programs loaded into a device's primary context, and the launch of their kernels, through the
// driver API (cuda_driver.h). The caller names the stream: runtime/cuda_launch.h finds torch's current one.
#include <string>

#include "codegen/cuda/cuda_driver.h"

namespace kiln::codegen::cuda {

/// A program image (cubin, or PTX for the driver to JIT) loaded into one device's primary context.
/// Loaded modules live until the process ends: kernels are cached for its whole life, and unloading
/// during interpreter teardown would race the driver's.
class LoadedProgram {
 public:
  /// Loads `image` (cubin bytes, or NUL-free PTX text) on device `ordinal`.
  LoadedProgram(int ordinal, const std::string& image);
  LoadedProgram(const LoadedProgram&) = delete;
  LoadedProgram& operator=(const LoadedProgram&) = delete;

  /// The kernel named `name` (its extern "C" name). Throws kiln::Error naming the kernel when absent.
  CudaFunction function(const std::string& name) const;
  int device() const { return device_; }

 private:
  int device_;
  CudaModule module_ = nullptr;
};

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

struct LaunchConfig {
  Dim3 grid;
  Dim3 block;
  unsigned shared_bytes = 0;
};

/// Launches `function` (of a program loaded on device `ordinal`) with the packed argument array `args`
/// (one pointer to each argument's value, as cuLaunchKernel takes them) on `stream`. Asynchronous: no host
/// synchronisation. A rejected launch (too many threads per block, too much shared memory) throws
/// kiln::Error naming `kernel_name`, the configuration and the kernel's own limits.
void launch_kernel(int ordinal, CudaFunction function, const std::string& kernel_name, const LaunchConfig& config,
                   CudaStream stream, void** args);

}  // namespace kiln::codegen::cuda
