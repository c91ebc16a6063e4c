// The CUDA schedulers of reductions along rows (kernel_schedule.h): warp_per_row and block_per_row.
//
// Design: a row is one output's reduced elements. Rows of at most kWarpRowLimit elements take one warp each,
// kRowsPerBlock rows per block: each lane strides over the row and the lanes combine with register shuffles, no
// shared memory or barrier. Longer rows take a block each, combined through shared memory (kiln_reduce.cuh).
//
// The passes over a row move vectors (row_vector_width) where every access along the reduced loop is contiguous
// and the row splits into whole, aligned vectors; a run-time alignment test picks them, else scalar passes.
// A kernel with several passes (layer norm: its mean, its variance, its output) reads the row once into registers
// where the vectors fit (cached rows, cached_row_chunks) instead of re-reading it from L1 or L2 in every pass.
#include <algorithm>
#include <utility>

#include "codegen/cuda/cuda_text.h"
#include "codegen/cuda/kernel_schedule.h"

namespace kiln::codegen::cuda {

using fusion::Expr;
using fusion::ExprKind;

namespace {

// Elements per lane and step in the row passes: vectors along the one reduced loop, when every access that runs
// along it is contiguous there, the row length and every outer stride and offset of those accesses are multiples
// of the width (so vectors stay inside a row and aligned once the base pointers are).
int row_vector_width(const KernelAnalysis& a) {
  const fusion::Kernel& k = a.kernel;
  const fusion::LoopNest& nest = a.nest;
  if (static_cast<int>(nest.loops.size()) != nest.outer_count + 1 || k.scalar_loads_only()) return 1;
  const size_t red = nest.loops.size() - 1;
  int width = 8;
  std::vector<std::pair<const std::vector<int64_t>*, int64_t>> contiguous;
  for (size_t i = 0; i < k.exprs.size(); ++i) {
    const Expr& e = k.exprs[i];
    if (e.kind != ExprKind::Load || nest.load_strides[i][red] == 0) continue;
    if (nest.load_strides[i][red] != 1) return 1;
    width = std::min(width, 16 / type_info(k.buffers[e.buffer].dtype).bytes);
    contiguous.push_back({&nest.load_strides[i], e.index.offset});
  }
  for (size_t s = 0; s < k.stores.size(); ++s) {
    if (nest.store_strides[s][red] == 0) continue;
    if (nest.store_strides[s][red] != 1) return 1;
    width = std::min(width, 16 / type_info(k.buffers[k.stores[s].buffer].dtype).bytes);
    contiguous.push_back({&nest.store_strides[s], k.stores[s].index.offset});
  }
  if (contiguous.empty()) return 1;
  width = std::min<int64_t>(width, 4);  // 4 lanes already give 16-byte float loads; more only adds registers
  for (; width >= 2; width /= 2) {
    bool fits = nest.loops[red].size % width == 0 && nest.loops[red].size >= width * 32;
    for (const auto& [strides, offset] : contiguous) {
      fits = fits && offset % width == 0;
      for (size_t l = 0; l < red; ++l) fits = fits && (*strides)[l] % width == 0;
    }
    if (fits) return width;
  }
  return 1;
}

// Passes over the reduced loops that the emitter makes: one per walk of reductions (the first computes every
// reduction whose operand uses no other reduction, each later one a reduction that needs an earlier one's
// result), and one for the stores along the reduced loops.
int row_passes(const KernelAnalysis& a) {
  int passes = 0;
  bool first_walk = false;
  for (const Expr& e : a.kernel.exprs) {
    if (e.kind != ExprKind::Reduce) continue;
    if (a.uses_reductions[e.operands[0]]) ++passes;
    else first_walk = true;
  }
  bool along = false;
  for (size_t s = 0; s < a.kernel.stores.size(); ++s) along = along || a.store_along_reduced(s);
  return passes + (first_walk ? 1 : 0) + (along ? 1 : 0);
}

}  // namespace

// Cached rows: when a row takes several passes and its vector loads fit in registers (at most kCachedRowChunks
// vectors per load and thread, kCachedRowWords registers in all), each thread reads its part of the row once,
// before the first pass, and every pass takes the values from registers. Returns the vectors per thread and load
// (the passes' unrolled steps), or 0 where the passes read memory.
int cached_row_chunks(const KernelAnalysis& a, int width, int64_t threads_per_row) {
  // A layer norm's three passes re-read its row (from L1 or L2) twice: 24 us per ViT layer norm (6304 rows of
  // 768, an add and two outputs) against 14-26 us for torch.compile's kernels, which keep the row in registers.
  if (width <= 1 || row_passes(a) < 2) return 0;
  const fusion::Kernel& k = a.kernel;
  const int64_t vectors = a.nest.reduced_numel() / width;  // row_vector_width: the row is a multiple of the width
  const int64_t chunks = (vectors + threads_per_row - 1) / threads_per_row;
  int64_t words = 0;
  for (size_t i = 0; i < k.exprs.size(); ++i) {
    const Expr& e = k.exprs[i];
    if (e.kind == ExprKind::Load && a.contiguous_along_reduced(a.nest.load_strides[i]))
      words += chunks * ((width * type_info(k.buffers[e.buffer].dtype).bytes + 3) / 4);
  }
  return chunks <= kCachedRowChunks && words > 0 && words <= kCachedRowWords ? static_cast<int>(chunks) : 0;
}

// The threads of a block_per_row kernel: for vectors of `width` elements (width > 1), the fewest warps that cover
// the row in as few steps as kRowBlockVectors threads would; otherwise about four elements each.
int64_t block_row_threads(const KernelAnalysis& a, int width) {
  const int64_t reduced = a.nest.reduced_numel();
  if (width <= 1) return std::min<int64_t>(1024, std::max<int64_t>(64, pow2_ceil((reduced + 3) / 4)));
  // 768 floats as vectors of 4 are 192 threads (6 warps), where the power of two above left 64 of 256 idle
  const int64_t vectors = reduced / width;
  const int64_t steps = (vectors + kRowBlockVectors - 1) / kRowBlockVectors;
  return ((vectors + steps - 1) / steps + 31) / 32 * 32;
}

CudaKernelSchedule schedule_warp_per_row(const KernelAnalysis& a) {
  CudaKernelSchedule s;
  s.kind = CudaKernelKind::WarpPerRow;
  s.rows_per_block = kRowsPerBlock;
  s.block_x = 32;
  s.block_y = kRowsPerBlock;
  s.row_vector_width = row_vector_width(a);
  s.cached_row_chunks = cached_row_chunks(a, s.row_vector_width, 32);
  return s;
}

CudaKernelSchedule schedule_block_per_row(const KernelAnalysis& a) {
  CudaKernelSchedule s;
  s.kind = CudaKernelKind::BlockPerRow;
  s.rows_per_block = 1;
  s.row_vector_width = row_vector_width(a);
  const unsigned threads = static_cast<unsigned>(block_row_threads(a, s.row_vector_width));
  s.block_x = threads;
  s.cached_row_chunks = cached_row_chunks(a, s.row_vector_width, threads);
  // A row too long to cache over those threads may fit over the most a block has: a loss's logsumexp over Llama's
  // 32000 logits (two passes, 16 vectors per thread of 512) reads its row once with 8 vectors per thread of 1000.
  if (s.cached_row_chunks == 0 && s.row_vector_width > 1 && threads < 1024) {
    const int64_t vectors = a.nest.reduced_numel() / s.row_vector_width;
    if (const int chunks = cached_row_chunks(a, s.row_vector_width, 1024); chunks > 0) {
      const int64_t wide = std::min<int64_t>(1024, ((vectors + chunks - 1) / chunks + 31) / 32 * 32);
      s.block_x = static_cast<unsigned>(wide);
      s.cached_row_chunks = cached_row_chunks(a, s.row_vector_width, wide);
    }
  }
  return s;
}

}  // namespace kiln::codegen::cuda
