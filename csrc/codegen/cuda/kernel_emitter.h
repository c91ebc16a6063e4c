#pragma once
// KernelEmitter: one fused kernel of the loop IR as CUDA C, for emit_cuda.cpp. It renders the CudaKernelSchedule
// that the schedulers chose (kernel_schedule.h) and decides nothing about the kernel's mapping onto threads.
// kernel_emitter.cpp holds the kernel frame, expressions and pointwise kernels; kernel_emitter_rows.cpp the
// reductions (warp, block and thread per row, column).
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "codegen/cuda/cuda_text.h"
#include "codegen/cuda/emit_cuda.h"
#include "codegen/cuda/kernel_schedule.h"
#include "fusion/loop_nest.h"

namespace kiln::codegen::cuda {

using decomp::PrimOp;
using decomp::ReduceOp;
using fusion::Expr;
using fusion::ExprKind;
using fusion::Kernel;
using graph::ScalarType;

// A graph's distinct kernels are split into up to kMaxParts NVRTC programs, compiled in parallel (up to 8 worker
// processes, nvrtc_workers.cpp): NVRTC's time grows with the program (resnet50's one program took ~3 s), and a
// graph's compile waits for its slowest part. One reduction kernel with cached rows takes NVRTC ~130 ms on its own,
// a pointwise one ~40 ms, and a part ~25 ms more for the program itself, so a kernel a part (up to kMaxParts) keeps
// the slowest part near the slowest kernel: a 2-block transformer's 3 parts of up to 4 kernels took up to 510 ms,
// and its first compile 560 ms; in 8 parts the slowest took 250 ms and the compile 310 ms (H100).
constexpr int kMaxParts = 8;

// "// kernel_3_add covers graph nodes: 4:aten::add.Tensor ...": the same line as the C++ generator's, which
// tools read to map kernels back to graph nodes.
std::string covers_comment(const Kernel& k, const graph::Graph& g);
// A kernel's parameter list: one pointer per buffer, `buf<i>`, or `<prefix><i>` (const for inputs).
std::string parameters(const Kernel& k, const std::string& prefix = "buf", size_t first = 0);

class KernelEmitter {
 public:
  // device_function: a pointwise kernel emitted as a __device__ function of a launch group, taking its block
  // index and block count within the group as its last two parameters (kiln_block, kiln_blocks).
  // `analysis` (its kernel too) must outlive the emitter.
  // `size_arguments`: the kernel reads its sizes at run time (codegen/size_arguments.h), from a `kiln_sizes<N>`
  // parameter after its buffers (where it has any slot); not for device functions.
  KernelEmitter(const KernelAnalysis& analysis, const CudaKernelSchedule& schedule, const graph::Graph& g,
                bool device_function = false, bool size_arguments = false);
  // The kernel's code; `launch` gets its name, strategy and launch configuration from the schedule, and with size
  // arguments its slots' values.
  std::string emit(CudaKernelLaunch& launch);
 private:
  bool is(CudaKernelKind kind) const { return schedule_.kind == kind; }
  std::string index(const std::vector<int64_t>& strides, int64_t offset) const {
    return index_text(strides, offset, sizes_);
  }
  // An integer the kernel reads (a loop's size, a count derived from sizes): a literal, or a size slot.
  std::string size(int64_t v) const { return sizes_(v); }
  // `const index_t i<first> .. i<last-1>` from the flat index `flat` (the last loop varies fastest).
  void decompose(const std::string& flat, int first, int last, const std::string& indent);
  // The C++ text of expression `e` (operands already named).
  std::string expression(int32_t e) const;
  // Emits `e` and its operands not yet named; names made here are forgotten by forget_scope().
  void emit_expr(int32_t e, const std::string& indent);
  void forget_scope();
  // Emits the per-row (reduction-independent) expressions `e` needs, stopping at dependent ones; their
  // names stay for the rest of the row.
  void emit_row_values(int32_t e, const std::string& indent);
  std::string store_text(size_t s, const std::string& value, bool scalar_index) const;
  // One element of a pointwise kernel at loop indices already in scope.
  void emit_scalar_element(const std::string& indent);
  void emit_pointwise(int64_t n);
  bool contiguous_along_reduced(const std::vector<int64_t>& strides) const { return a_.contiguous_along_reduced(strides); }
  std::string vec_type(int buffer, int width) const;
  // The run-time test that every access walking loop `axis` (default: the innermost) contiguously starts on a
  // `width`-element vector boundary (`a && b && ...`). The other strides are multiples of the width already
  // (the schedulers' vector widths ensure it), so the first element's address decides for all.
  std::string alignment_test(int width, int axis = -1) const;
  bool store_along_reduced(size_t s) const { return a_.store_along_reduced(s); }
  // Cached rows: opens the unrolled loop over a thread's vectors and the test that one is inside the row
  // (`red` is its first element); returns the indent of the step's body. The caller closes both braces.
  std::string open_cached_steps(const std::string& indent);
  // Opens a pass over the reduced loops, lanes striding (by row_width_ elements at a time); calls
  // `body(indent)` once per element of the step (lane_ set when vectorised) and stores the vectors of
  // `vector_stores` after it; closes the pass.
  template <typename Body>
  void reduced_pass(const std::string& indent, Body body, const std::vector<size_t>& vector_stores = {});
  // Cached rows: each thread's vectors of every contiguous load of the row, read into `lc<i>[chunk]`.
  void emit_row_cache(const std::string& indent);
  void emit_rows(int64_t rows);
  void emit_row_loop(int64_t rows, const std::string& base_indent);
  // The column kind's loop with schedule_.column_vector_width outputs per thread (after emit_rows' alignment test).
  void emit_column_vector_loop(int64_t rows, const std::string& base_indent);
  const Kernel& k_;
  const graph::Graph& g_;
  const KernelAnalysis& a_;
  const fusion::LoopNest& nest_;
  const std::vector<bool>& depends_;
  const std::vector<bool>& uses_reductions_;
  const CudaKernelSchedule schedule_;
  const bool device_function_;
  mutable SizeArguments sizes_;  // literals, or the kernel's size slots
  std::vector<std::string> names_;
  std::vector<int32_t> scope_;
  std::ostringstream* body_ = nullptr;
  // What is being emitted (the schedule says what to emit; these follow the emitter through it):
  bool column_lanes_ = false;  // emitting lanes along the columns (vector loads are along the innermost outer loop)
  int lane_ = -1;  // the vector lane being emitted, or -1 for scalar code
  int row_width_ = 1;  // elements per lane and step in the row passes being emitted
  int cached_chunks_ = 0;  // the row passes being emitted read cached rows (schedule_.cached_row_chunks), or 0
};

}  // namespace kiln::codegen::cuda
