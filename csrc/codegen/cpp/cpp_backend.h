#pragma once
// The CPU device backend (codegen/device_backend.h): every kernel of a graph in one C++17/OpenMP translation unit
// (emit_cpp.h), compiled by the system compiler into a shared library cached on disk (compile_cpp.h), kernels
// called as plain functions.
#include "codegen/device_backend.h"

namespace kiln::codegen::cpp {

const DeviceBackend& cpp_backend();

}  // namespace kiln::codegen::cpp
