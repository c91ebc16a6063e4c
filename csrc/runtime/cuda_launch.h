#pragma once
// The stream compiled CUDA kernels run on: torch's current one. Loading and launching through the driver API is
// codegen's (codegen/cuda/loaded_program.h, codegen/cuda/cuda_backend.h); runtime adds only the stream torch uses. kiln._C is built
// against CPU torch too, so nothing here includes c10/cuda headers or links CUDA libraries: torch's current
// stream is read through libc10_cuda's exported `c10::cuda::getCurrentCUDAStream`, resolved with dlsym the
// first time a CUDA launch needs it.
#include "codegen/cuda/loaded_program.h"

namespace kiln::runtime::cuda {

using codegen::cuda::CudaStream;

/// torch's current CUDA stream on device `ordinal` (what `torch.cuda.current_stream(ordinal).cuda_stream`
/// returns), as a driver stream handle. Costs two indirect calls; torch must have initialised CUDA.
/// Throws kiln::Error when torch's CUDA library is not loaded (CPU-only torch).
CudaStream torch_current_stream(int ordinal);

}  // namespace kiln::runtime::cuda
