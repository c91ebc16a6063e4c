// The CUDA scheduler of column reductions (kernel_schedule.h): reductions whose inputs are contiguous along the
// outputs rather than along the reduced dims (a bias gradient, a sum over the batch dim).
//
// Design: neighbouring outputs share a block, one per threadIdx.x, so each warp reads consecutive elements of a
// row; threadIdx.y splits the reduced range, combined in shared memory. A row-wise kernel would make every lane
// read a different row's element, one 32-byte sector per 4 bytes used. The block's width, its depth along the
// rows and the columns per thread trade whole-line reads against enough blocks and threads to fill the GPU: the
// measurements behind each choice are beside it.
#include <algorithm>
#include <utility>

#include "codegen/cuda/cuda_text.h"
#include "codegen/cuda/kernel_schedule.h"

namespace kiln::codegen::cuda {

using fusion::Expr;
using fusion::ExprKind;

namespace {

// Outputs per thread: 4 (2 for 8-byte types) neighbouring columns with vector accesses where every access that
// walks the columns does so contiguously and along the rows too, every reduction reads only loads, and every
// per-column store is a reduction's result; else 1.
int column_vector_width(const KernelAnalysis& a) {
  const fusion::Kernel& k = a.kernel;
  const fusion::LoopNest& nest = a.nest;
  if (k.scalar_loads_only()) return 1;
  // Four columns per thread leave a quarter of the threads: on an H200 that paid only with 98304 outputs (vit_train's
  // fused gelu gradient + bias sums, 97 -> 85 us); with 24576 (its layer norm sums, 12.2 -> 17.4 us) or 768 (bias
  // sums of 6304 rows, 9.8 -> 17.8 us) it lost.
  if (nest.outer_numel() < kColumnVectorOutputsWanted) return 1;
  const int inner = nest.outer_count - 1;
  const int64_t columns = nest.loops[inner].size;
  int width = 4;
  std::vector<std::pair<const std::vector<int64_t>*, int64_t>> contiguous;  // strides, offset
  for (size_t i = 0; i < k.exprs.size(); ++i) {
    const Expr& e = k.exprs[i];
    if (e.kind == ExprKind::Reduce && a.uses_reductions[e.operands[0]]) return 1;  // one walk only
    if (e.kind != ExprKind::Load) continue;
    if (e.operands[0] >= 0) return 1;  // guarded loads are scalar
    const auto& strides = nest.load_strides[i];
    if (strides[inner] == 0) continue;  // the same for every column of a row: one scalar load
    if (!a.depends[i]) return 1;        // a value per column, the same along the rows (not handled here)
    width = std::min(width, 16 / type_info(k.buffers[e.buffer].dtype).bytes);
    contiguous.push_back({&strides, e.index.offset});
  }
  for (size_t s = 0; s < k.stores.size(); ++s) {
    const fusion::Store& st = k.stores[s];
    if (a.store_along_reduced(s)) {
      width = std::min(width, 16 / type_info(k.buffers[st.buffer].dtype).bytes);
      contiguous.push_back({&nest.store_strides[s], st.index.offset});
      continue;
    }
    const Expr& x = k.exprs[st.expr];  // a reduction's result, stored per column (cast to the output's type)
    const bool reduction = x.kind == ExprKind::Reduce ||
                           (x.kind == ExprKind::Cast && k.exprs[x.operands[0]].kind == ExprKind::Reduce);
    if (!reduction) return 1;
  }
  for (; width >= 2; width /= 2) {
    bool fits = columns % width == 0;
    for (const auto& [strides, offset] : contiguous) {
      fits = fits && offset % width == 0;
      for (size_t l = 0; l < strides->size(); ++l)
        if (static_cast<int>(l) != inner) fits = fits && (*strides)[l] % width == 0;
    }
    if (fits) return width;
  }
  return 1;
}

}  // namespace

bool column_shaped(const KernelAnalysis& a) {
  const fusion::Kernel& k = a.kernel;
  const fusion::LoopNest& nest = a.nest;
  const int inner = nest.outer_count - 1;
  if (inner < 0) return false;
  bool contiguous = false;
  for (size_t i = 0; i < k.exprs.size(); ++i) {
    if (k.exprs[i].kind != ExprKind::Load) continue;
    const auto& strides = nest.load_strides[i];
    // A value per row, the same for every column (a layer norm's mean and rstd), is read once per step by all
    // of a warp's threads: it may walk the rows contiguously.
    for (size_t l = nest.outer_count; l < strides.size(); ++l)
      if (strides[l] == 1 && strides[inner] != 0) return false;
    if (strides[inner] != 0 && strides[inner] != 1) return false;
    contiguous = contiguous || (strides[inner] == 1 && nest.runs_reduced(strides));
  }
  for (size_t s = 0; s < k.stores.size(); ++s) {
    if ((a.store_along_reduced(s) && a.uses_reductions[k.stores[s].expr]) || nest.store_strides[s][inner] != 1) return false;
  }
  return contiguous;
}

CudaKernelSchedule schedule_column(const KernelAnalysis& a) {
  CudaKernelSchedule s;
  s.kind = CudaKernelKind::Column;
  const int64_t reduced = a.nest.reduced_numel();
  s.column_vector_width = column_vector_width(a);
  const int64_t groups = a.nest.outer_numel() / s.column_vector_width;  // each thread's outputs: neighbouring columns
  // 32 outputs per block read whole 128-byte lines, but a bias gradient of 512 columns then fills 16 blocks of an
  // H200's 132 multiprocessors (14 us for 4096 rows, where the copy bound is 3 us). Narrower blocks (8 floats still
  // fill a 32-byte sector) with more threads per column keep more of the GPU busy.
  s.column_width = groups >= 32 * kColumnBlocksWanted ? 32 : groups >= 16 * kColumnBlocksWanted ? 16 : 8;
  s.block_x = static_cast<unsigned>(s.column_width);
  // Threads along the rows: about 16 rows each (with 6, a ViT's 197 rows over 32 threads, the block's shared-memory
  // combine cost a fused producer + sum 86 us where 8 threads per column took 74: H200, 32x197x3072,
  // benchmarks/fused_column_sums_cuda.py; 12 rows over 16 threads made ViT's layer norm weight gradients 28% slower
  // than 25 over 8), more (down to 4 rows each) where there are too few outputs to give kColumnThreadsWanted threads.
  const int64_t by_rows = pow2_floor(std::max<int64_t>(reduced / 16, 1));
  // (An empty domain has no groups; it launches nothing, schedule_cuda_kernel sees to that.)
  const int64_t by_threads = pow2_ceil((kColumnThreadsWanted + groups - 1) / std::max<int64_t>(groups, 1));
  s.block_y = static_cast<unsigned>(std::clamp<int64_t>(std::max(by_rows, by_threads), 1, column_rows_limit(a, s.column_width)));
  return s;
}

int64_t column_rows_limit(const KernelAnalysis& a, int column_width) {
  return std::min<int64_t>(1024 / column_width, pow2_floor(std::max<int64_t>(a.nest.reduced_numel() / 4, 1)));
}

}  // namespace kiln::codegen::cuda
