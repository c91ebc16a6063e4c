#pragma once
// KernelEmitter: one fused kernel of the loop IR as CUDA C, for emit_cuda.cpp (whose file comment describes
// the strategies). kernel_emitter.cpp holds the kernel frame, expressions and pointwise kernels;
// kernel_emitter_rows.cpp the reduction strategies (warp, block and thread per row, column).
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "codegen/cuda/cuda_text.h"
#include "codegen/cuda/emit_cuda.h"
#include "fusion/loop_nest.h"

namespace kiln::codegen::cuda {

using decomp::PrimOp;
using decomp::ReduceOp;
using fusion::Expr;
using fusion::ExprKind;
using fusion::Kernel;
using graph::ScalarType;

constexpr unsigned kPointwiseBlock = 256;
constexpr unsigned kRowsPerBlock = 8;       // warp_per_row: one warp per row, 8 warps per block
constexpr int64_t kWarpRowLimit = 512;      // rows up to this long reduce within one warp
constexpr int64_t kColumnVectorOutputsWanted = 65536;  // column strategy: 4 columns per thread from this many outputs
constexpr int64_t kColumnThreadsWanted = 65536;  // column strategy: more threads along the rows below this many
constexpr int64_t kColumnBlocksWanted = 256;  // column strategy: narrower blocks until about this many
constexpr int64_t kThreadRowLimit = 64;     // pooling windows up to this size are walked by one thread
constexpr int64_t kRowBlockVectors = 512;   // block_per_row with vectors: at most this many threads per row
constexpr int64_t kCachedRowChunks = 8;     // cached rows: at most this many vectors of each load per thread
constexpr int64_t kCachedRowWords = 64;     // cached rows: at most this many 32-bit registers of loads per thread
constexpr int64_t kMaxGrid = int64_t{1} << 20;  // grid-stride loops cover the rest
constexpr int64_t kIndex32Limit = (int64_t{1} << 31) - 1;
// A graph's kernels are split into up to kMaxParts NVRTC programs of about kKernelsPerPart distinct kernels,
// compiled in parallel: NVRTC's time grows with the program, and resnet50's one program took ~3 s.
constexpr int kKernelsPerPart = 4;
constexpr int kMaxParts = 8;

int64_t pow2_ceil(int64_t v);
int64_t pow2_floor(int64_t v);
// "// kernel_3_add covers graph nodes: 4:aten::add.Tensor ...": the same line as the C++ generator's, which
// tools read to map kernels back to graph nodes.
std::string covers_comment(const Kernel& k, const graph::Graph& g);
// A kernel's parameter list: one pointer per buffer, `buf<i>`, or `<prefix><i>` (const for inputs).
std::string parameters(const Kernel& k, const std::string& prefix = "buf", size_t first = 0);

class KernelEmitter {
 public:
  // device_function: a pointwise kernel emitted as a __device__ function of a launch group, taking its block
  // index and block count within the group as its last two parameters (kiln_block, kiln_blocks).
  KernelEmitter(const Kernel& k, const graph::Graph& g, bool device_function = false);
  std::string emit(CudaKernelLaunch& launch);
 private:
  // 64-bit indices when any element index, or a loop index plus its grid-stride step, could reach 2^31 - 1.
  bool needs_64bit_index(const CudaKernelLaunch& launch) const;
  // A reduction kernel whose accesses walk the innermost output loop contiguously and never the reduced
  // loops: the column strategy (see the file comment). Its stores are one value per output, or values along
  // the reduced loops that use no reduction (a fused producer's result), made in the first reduction's walk.
  bool column_shaped() const;
  // Elements per thread for 16-byte accesses, or 1. Vectors run along the innermost loop: every load
  // walks it with stride 0 or 1 and every store with stride 1. With outer loops too (a bias or a per-channel
  // scale broadcast along rows), the innermost size and every outer stride of a contiguous access must be
  // multiples of the width, so that a vector never straddles two rows and stays aligned.
  int vector_width() const;
  std::string index(const std::vector<int64_t>& strides, int64_t offset) const { return index_text(strides, offset); }
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
  // Elements per lane and step in the row passes: vectors along the one reduced loop, when every access that
  // runs along it is contiguous there, the row length and every outer stride and offset of those accesses are
  // multiples of the width (so vectors stay inside a row and aligned once the base pointers are).
  int row_vector_width() const;
  bool contiguous_along_reduced(const std::vector<int64_t>& strides) const { return strides.back() == 1 && nest_.runs_reduced(strides); }
  std::string vec_type(int buffer, int width) const;
  // The run-time test that every access walking loop `axis` (default: the innermost) contiguously starts on a
  // `width`-element vector boundary (`a && b && ...`). The other strides are multiples of the width already
  // (vector_width, row_vector_width, column_vector_width), so the first element's address decides for all.
  std::string alignment_test(int width, int axis = -1) const;
  // Store s writes along the reduced loops (a value per element, not one per output).
  bool store_along_reduced(size_t s) const {
    return depends_[k_.stores[s].expr] || nest_.runs_reduced(nest_.store_strides[s]);
  }
  // Passes over the reduced loops that emit_row_loop makes: one per walk of reductions, one for the stores
  // along the reduced loops.
  int row_passes() const;
  // Cached rows: when a row takes several passes and its vector loads fit in registers (at most
  // kCachedRowChunks vectors per load and thread, kCachedRowWords registers in all), each thread reads its
  // part of the row once, before the first pass, and every pass takes the values from registers. Returns
  // the vectors per thread and load (the passes' unrolled steps), or 0 where the passes read memory.
  int cached_row_chunks(int width, int64_t threads_per_row) const;
  // The threads of a block_per_row kernel: for vectors of `width` elements (width > 1), the fewest warps that
  // cover the row in as few steps as kRowBlockVectors threads would; otherwise about four elements each.
  int64_t block_row_threads(int width) const;
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
  // Outputs per thread of the column strategy: 4 (2 for 8-byte types) neighbouring columns with vector accesses
  // where every access that walks the columns does so contiguously and along the rows too, every reduction reads
  // only loads, and every per-column store is a reduction's result; else 1.
  int column_vector_width() const;
  // The column strategy's loop with column_vec_ outputs per thread (after emit_rows' alignment test).
  void emit_column_vector_loop(int64_t rows, const std::string& base_indent);
  const Kernel& k_;
  const graph::Graph& g_;
  fusion::LoopNest nest_;
  const bool device_function_;
  std::vector<bool> depends_;
  std::vector<bool> uses_reductions_;  // fusion::uses_reductions
  std::vector<std::string> names_;
  std::vector<int32_t> scope_;
  std::ostringstream* body_ = nullptr;
  std::string index_type_;
  bool rows_ = false;
  bool block_reduce_ = false;
  bool column_ = false;  // the column strategy (column_shaped)
  int column_width_ = 32;  // threads along the columns per block of the column strategy
  int column_vec_ = 1;     // columns per thread of the column strategy (column_vector_width)
  bool column_lanes_ = false;  // emitting lanes along the columns (vector loads are along the innermost outer loop)
  bool thread_row_ = false;  // the thread_per_row strategy (small pooling windows)
  int vector_width_ = 1;
  int lane_ = -1;  // the vector lane being emitted, or -1 for scalar code
  int row_width_ = 1;  // elements per lane and step in the row passes being emitted
  int row_vec_ = 1;    // the row passes' vector width when the alignment test passes (row_vector_width)
  int cached_chunks_ = 0;  // cached rows (cached_row_chunks): vector steps per pass, each unrolled
};

}  // namespace kiln::codegen::cuda
