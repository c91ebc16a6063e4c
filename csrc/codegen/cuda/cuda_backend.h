#pragma once
// The CUDA device backend (codegen/device_backend.h): a graph's kernels as CUDA C in up to a few NVRTC programs
// (emit_cuda.h), compiled side by side to cubins for the running GPU and cached on disk (cuda_program_cache.h),
// launched through the driver API on torch's current stream with no host synchronisation.
#include "codegen/device_backend.h"

namespace kiln::codegen::cuda {

const DeviceBackend& cuda_backend();

}  // namespace kiln::codegen::cuda
