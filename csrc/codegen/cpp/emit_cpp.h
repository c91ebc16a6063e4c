#pragma once
/// Loop IR -> one C++17/OpenMP translation unit for all kernels of a schedule.
///
/// Needs: verified kernels (fusion::verify_kernel). Guarantees: one `extern "C" void <kernel.name>(void*
/// const* buffers)` per kernel with stores, where buffers[i] is the data pointer of kernel.buffers[i]
/// (already offset to the tensor's first element); shapes and strides are compile-time constants. With size arguments
/// (codegen/size_arguments.h) the functions are `(void* const* buffers, const int64_t* sizes)` instead, reading the
/// kernel's sizes, strides and offsets from `sizes` (CppSource::sizes).
#include <cstdint>
#include <string>
#include <vector>

#include "fusion/loop_ir.h"
#include "graph/graph.h"

namespace kiln::codegen::cpp {

struct CppSource {
  std::string text;
  std::vector<std::string> functions;  // per schedule kernel: the function that runs it (see emit_cpp_source)
  std::vector<std::vector<int64_t>> sizes;  // per schedule kernel: its size slots' values (size arguments only)
};

/// Kernels whose code is the same but for their name (each block of a layer stack makes the same ones) are
/// emitted once: `functions` names, per kernel, the function to call.
/// `size_arguments`: kernels read their sizes at run time (codegen/size_arguments.h).
CppSource emit_cpp_source(const fusion::Schedule& schedule, const graph::Graph& g, bool size_arguments = false);

/// One kernel's function (no prelude): for tests and logs.
std::string emit_cpp_kernel(const fusion::Kernel& kernel, const graph::Graph& g, bool size_arguments = false,
                            std::vector<int64_t>* sizes = nullptr);

}  // namespace kiln::codegen::cpp
