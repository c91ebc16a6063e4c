#pragma once
// The device helper headers (csrc/device_lib/cuda/*.cuh) that generated CUDA sources #include by name.
//
// Where they come from: when the build embeds them (a generated `device_lib/cuda_embedded.h`, see the CMake
// step in the CUDA backend's notes), from the binary; until then they are read once at run time from the
// folder beside the extension module: <dir of kiln/_C*.so>/device_lib/cuda (an installed package) or
// <dir of kiln/_C*.so>/../../csrc/device_lib/cuda (the source tree, KILN_DEV_OUTPUT builds).
#include <string>
#include <vector>

#include "codegen/cuda/nvrtc_compiler.h"

namespace kiln::codegen::cuda {

/// Every device helper header, by file name ("kiln_reduce.cuh"), read once per process.
/// Throws kiln::Error naming the folders searched when none holds them.
const std::vector<CudaHeader>& cuda_device_headers();

/// Where the headers were read from ("embedded" when compiled in).
std::string cuda_device_lib_origin();

}  // namespace kiln::codegen::cuda
