#pragma once
// Loading compiled CUDA programs and launching their kernels on torch's current stream, through the
// driver API (runtime/cuda_driver.h). kiln._C is built against CPU torch too, so nothing here includes
// c10/cuda headers or links CUDA libraries: torch's current stream is read through libc10_cuda's exported
// `c10::cuda::getCurrentCUDAStream`, resolved with dlsym the first time a CUDA launch needs it.
#include <memory>
#include <string>
#include <vector>

#include "runtime/cuda_driver.h"

namespace kiln::runtime::cuda {

/// torch's current CUDA stream on device `ordinal` (what `torch.cuda.current_stream(ordinal).cuda_stream`
/// returns), as a driver stream handle. Costs two indirect calls; torch must have initialised CUDA.
/// Throws kiln::Error when torch's CUDA library is not loaded (CPU-only torch).
CudaStream torch_current_stream(int ordinal);

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

}  // namespace kiln::runtime::cuda
