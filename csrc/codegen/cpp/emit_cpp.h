#pragma once
/// Loop IR -> one C++17/OpenMP translation unit for all kernels of a schedule.
///
/// Needs: verified kernels (fusion::verify_kernel). Guarantees: one `extern "C" void <kernel.name>(void*
/// const* buffers)` per kernel with stores, where buffers[i] is the data pointer of kernel.buffers[i]
/// (already offset to the tensor's first element); shapes and strides are compile-time constants.
#include <string>

#include "fusion/loop_ir.h"
#include "graph/graph.h"

namespace kiln::codegen::cpp {

std::string emit_cpp_source(const fusion::Schedule& schedule, const graph::Graph& g);

/// One kernel's function (no prelude): for tests and logs.
std::string emit_cpp_kernel(const fusion::Kernel& kernel, const graph::Graph& g);

}  // namespace kiln::codegen::cpp
