// Program loading and kernel launch through the driver API, on a stream the caller names.
#include "codegen/cuda/loaded_program.h"

#include <sstream>

#include "common/error.h"
#include "common/log.h"

namespace kiln::codegen::cuda {

LoadedProgram::LoadedProgram(int ordinal, const std::string& image) : device_(ordinal) {
  KILN_CHECK(!image.empty()) << "cannot load an empty CUDA program image";
  DeviceContextGuard context(ordinal);
  check(driver().cuModuleLoadData(&module_, image.data()), "cuModuleLoadData (loading a compiled CUDA program)");
}

CudaFunction LoadedProgram::function(const std::string& name) const {
  CudaFunction function = nullptr;
  CudaResult result = driver().cuModuleGetFunction(&function, module_, name.c_str());
  KILN_CHECK(result == 0) << "the CUDA program has no kernel named '" << name << "' (" << describe_error(result)
                          << "): kernels must be declared extern \"C\" __global__ so their names are not mangled";
  return function;
}

void launch_kernel(int ordinal, CudaFunction function, const std::string& kernel_name, const LaunchConfig& config,
                   CudaStream stream, void** args) {
  const DriverApi& a = driver();
  DeviceContextGuard context(ordinal);
  CudaResult result = a.cuLaunchKernel(function, config.grid.x, config.grid.y, config.grid.z, config.block.x,
                                       config.block.y, config.block.z, config.shared_bytes, stream, args, nullptr);
  if (result == 0) return;
  // Explain with the kernel's own limits: most rejected launches exceed one of them.
  int max_threads = -1, registers = -1;
  a.cuFuncGetAttribute(&max_threads, kFunctionAttributeMaxThreadsPerBlock, function);
  a.cuFuncGetAttribute(&registers, kFunctionAttributeNumRegisters, function);
  std::ostringstream what;
  what << "launching CUDA kernel '" << kernel_name << "' with grid (" << config.grid.x << ", " << config.grid.y
       << ", " << config.grid.z << "), block (" << config.block.x << ", " << config.block.y << ", " << config.block.z
       << "), " << config.shared_bytes << " bytes of shared memory [the kernel allows at most " << max_threads
       << " threads per block and uses " << registers << " registers per thread]";
  KILN_LOG(fallbacks) << what.str() << " failed: " << describe_error(result);
  check(result, what.str().c_str());
}

}  // namespace kiln::codegen::cuda
