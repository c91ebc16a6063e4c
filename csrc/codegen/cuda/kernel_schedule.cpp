// The CUDA scheduler's dispatcher (kernel_schedule.h): which kind a kernel is, in one table, and what every kind
// shares (the index width, the strategy's name).
//
// Design: the kinds are tried in order and the first whose condition holds schedules the kernel; each later
// condition may assume the earlier ones failed. A kernel without reductions is pointwise. Pooling windows small
// enough to walk serially take one thread per output, which keeps channels-last reads coalesced where a warp per
// 9-element window idled 23 lanes. Reductions whose accesses run along the outputs take the column kind, whose
// warps read consecutive outputs. The other reductions run along their rows: a warp per row up to kWarpRowLimit
// elements, a block per row beyond.
//
// Index arithmetic is 32-bit (cheaper, and fewer registers) when every index a kernel forms, and every loop index
// plus its grid-stride step, stays below 2^31 - 1; else 64-bit.
#include "codegen/cuda/kernel_schedule.h"

#include <algorithm>
#include <cstdlib>
#include <iterator>

#include "common/error.h"

namespace kiln::codegen::cuda {

using fusion::Expr;
using fusion::ExprKind;

namespace {

// The conditions of the dispatcher table, each given that no earlier row's holds.
bool no_reduction(const KernelAnalysis& a) { return !a.reduces(); }
bool small_window(const KernelAnalysis& a) {
  return a.kernel.window_reduction && a.nest.reduced_numel() <= kThreadRowLimit;
}
bool short_rows(const KernelAnalysis& a) { return a.nest.reduced_numel() <= kWarpRowLimit; }
bool long_rows(const KernelAnalysis&) { return true; }

struct SchedulerEntry {
  CudaKernelKind kind;
  bool (*applies)(const KernelAnalysis&);
  CudaKernelSchedule (*schedule)(const KernelAnalysis&);
};

// The first row whose condition holds schedules the kernel.
const SchedulerEntry kSchedulers[] = {
    {CudaKernelKind::Pointwise, no_reduction, schedule_pointwise},
    {CudaKernelKind::ThreadPerRow, small_window, schedule_thread_per_row},
    {CudaKernelKind::Column, column_shaped, schedule_column},
    {CudaKernelKind::WarpPerRow, short_rows, schedule_warp_per_row},
    {CudaKernelKind::BlockPerRow, long_rows, schedule_block_per_row},
};

// The strategy names, indexed by CudaKernelKind: logs, tests and compiled_graph_summary read them.
constexpr const char* kKindNames[] = {"pointwise", "thread_per_row", "column", "warp_per_row", "block_per_row"};
static_assert(std::size(kKindNames) == static_cast<size_t>(CudaKernelKind::BlockPerRow) + 1, "one name per kind");

bool needs_64bit_index(const KernelAnalysis& a, const CudaKernelSchedule& s) {
  const fusion::Kernel& k = a.kernel;
  const fusion::LoopNest& nest = a.nest;
  const int64_t threads = int64_t{s.grid} * s.block_x * s.block_y;
  int64_t largest = nest.outer_numel() + threads;
  largest = std::max(largest, nest.reduced_numel() + s.block_x);
  auto extent = [&](const std::vector<int64_t>& strides, int64_t offset) {
    int64_t e = std::llabs(offset);
    for (size_t l = 0; l < strides.size(); ++l) e += std::llabs(strides[l]) * std::max<int64_t>(nest.loops[l].size - 1, 0);
    return e;
  };
  for (size_t i = 0; i < k.exprs.size(); ++i)
    if (fusion::Kernel::has_index(k.exprs[i]))
      largest = std::max<int64_t>(largest, extent(nest.load_strides[i], k.exprs[i].index.offset) +
                                               std::llabs(k.exprs[i].gather_stride) *
                                                   std::max<int64_t>(k.exprs[i].gather_extent - 1, 0));
  for (size_t s = 0; s < k.stores.size(); ++s)
    largest = std::max(largest, extent(nest.store_strides[s], k.stores[s].index.offset));
  for (size_t i = 0; i < k.exprs.size(); ++i)
    for (size_t b = 0; b < k.exprs[i].bounds.size(); ++b)
      largest = std::max(largest, extent(nest.bound_strides[i][b], k.exprs[i].bounds[b].index.offset));
  return largest >= kIndex32Limit;
}

}  // namespace

KernelAnalysis::KernelAnalysis(const fusion::Kernel& k)
    : kernel(k), nest(fusion::build_loop_nest(k)), depends(fusion::depends_on_reduced_loops(k, nest)),
      uses_reductions(fusion::uses_reductions(k)) {}

bool KernelAnalysis::reduces() const {
  for (const Expr& e : kernel.exprs)
    if (e.kind == ExprKind::Reduce) return true;
  return nest.outer_count < static_cast<int>(nest.loops.size());
}

bool KernelAnalysis::store_along_reduced(size_t s) const {
  return depends[kernel.stores[s].expr] || nest.runs_reduced(nest.store_strides[s]);
}

CudaKernelSchedule schedule_cuda_kernel(const KernelAnalysis& a) {
  const SchedulerEntry* entry = std::find_if(std::begin(kSchedulers), std::end(kSchedulers),
                                             [&](const SchedulerEntry& e) { return e.applies(a); });
  KILN_ASSERT(entry != std::end(kSchedulers)) << "kernel " << a.kernel.name << ": no CUDA scheduler applies";
  CudaKernelSchedule s = entry->schedule(a);
  KILN_ASSERT(s.kind == entry->kind) << "kernel " << a.kernel.name << ": the "
                                     << kKindNames[static_cast<int>(entry->kind)] << " scheduler returned another kind";
  finish_schedule(a, s);
  return s;
}

void finish_schedule(const KernelAnalysis& a, CudaKernelSchedule& s) {
  s.grid = a.nest.outer_numel() == 0 ? 0 : launch_grid(a, s);
  s.index_64bit = needs_64bit_index(a, s);
}

unsigned launch_grid(const KernelAnalysis& a, const CudaKernelSchedule& s) {
  auto ceil_div = [](int64_t n, int64_t d) { return (n + d - 1) / d; };
  const int64_t outer = a.nest.outer_numel();
  int64_t blocks = 0;
  switch (s.kind) {
    case CudaKernelKind::Pointwise:
    case CudaKernelKind::ThreadPerRow:  // a thread per element or vector (per output: vector_width is 1)
      blocks = ceil_div(ceil_div(outer, s.vector_width), s.block_x);
      break;
    case CudaKernelKind::Column:  // column_width groups of column_vector_width neighbouring outputs per block
      blocks = ceil_div(ceil_div(outer, s.column_vector_width), s.column_width);
      break;
    case CudaKernelKind::WarpPerRow:
    case CudaKernelKind::BlockPerRow:
      blocks = ceil_div(outer, s.rows_per_block);
      break;
  }
  return static_cast<unsigned>(std::min<int64_t>(blocks, kMaxGrid));
}

std::string strategy_name(const CudaKernelSchedule& s) {
  std::string name = kKindNames[static_cast<int>(s.kind)];
  if (s.vector_width > 1) name += "_vec" + std::to_string(s.vector_width);
  if (s.cached_row_chunks > 0) name += "_cached";
  return name;
}

int64_t pow2_ceil(int64_t v) {
  int64_t p = 1;
  while (p < v) p *= 2;
  return p;
}

int64_t pow2_floor(int64_t v) {
  int64_t p = 1;
  while (p * 2 <= v) p *= 2;
  return p;
}

}  // namespace kiln::codegen::cuda
