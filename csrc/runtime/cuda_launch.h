#pragma once
// Launching compiled CUDA kernels on torch's current stream. Loading and launching through the driver API is
// codegen's (codegen/cuda/loaded_program.h); runtime adds only the stream torch is using. kiln._C is built
// against CPU torch too, so nothing here includes c10/cuda headers or links CUDA libraries: torch's current
// stream is read through libc10_cuda's exported `c10::cuda::getCurrentCUDAStream`, resolved with dlsym the
// first time a CUDA launch needs it.
#include "codegen/cuda/loaded_program.h"

namespace kiln::runtime::cuda {

// The driver names runtime uses (launch, and the SM count its schedules read), so runtime code keeps saying
// cuda::launch_kernel whichever layer holds the driver.
using codegen::cuda::CudaFunction;
using codegen::cuda::CudaStream;
using codegen::cuda::LaunchConfig;
using codegen::cuda::launch_kernel;
using codegen::cuda::multiprocessor_count;

/// torch's current CUDA stream on device `ordinal` (what `torch.cuda.current_stream(ordinal).cuda_stream`
/// returns), as a driver stream handle. Costs two indirect calls; torch must have initialised CUDA.
/// Throws kiln::Error when torch's CUDA library is not loaded (CPU-only torch).
CudaStream torch_current_stream(int ordinal);

}  // namespace kiln::runtime::cuda
