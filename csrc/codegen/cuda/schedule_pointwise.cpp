// The CUDA schedulers that give each thread its own outputs (kernel_schedule.h): pointwise kernels, and
// thread_per_row for small pooling windows.
//
// Design: pointwise kernels (no reduction) run one thread per element in a grid-stride loop over the flat outer
// index, kPointwiseBlock threads per block and at most kMaxGrid blocks (about one trip per thread; the loop covers
// the rest). Where every access walks the innermost loop contiguously or not at all, each thread moves 16 bytes per
// access (`kiln::vec`, ld.global.v4) after a run-time alignment test, with a scalar loop for the tail and for
// unaligned views: that halves the instructions per byte of a copy-bound kernel.
//
// thread_per_row: fusion's window reductions of at most kThreadRowLimit elements (pooling) run one thread per
// output, like a pointwise kernel, each walking its window serially; neighbouring threads take neighbouring
// outputs, so channels-last reads are coalesced. A warp per 9-element window idled 23 lanes.
#include <algorithm>
#include <utility>

#include "codegen/cuda/cuda_text.h"
#include "codegen/cuda/kernel_schedule.h"

namespace kiln::codegen::cuda {

using fusion::Expr;
using fusion::ExprKind;

namespace {

// Elements per thread for 16-byte accesses, or 1. Vectors run along the innermost loop: every load walks it with
// stride 0 or 1 and every store with stride 1. With outer loops too (a bias or a per-channel scale broadcast along
// rows), the innermost size and every outer stride of a contiguous access must be multiples of the width, so that
// a vector never straddles two rows and stays aligned. Gathered loads are scalar. A guarded load (a padded read:
// cat, slice_backward, constant_pad_nd) is a vector where each bound of its guard is the same for a whole vector:
// it walks the innermost loop with stride 0, or with stride 1 from an offset, outer strides and extent that are
// multiples of the width, so a vector lies wholly inside the operand or wholly outside (a rotary embedding's
// halves of 64).
int pointwise_vector_width(const KernelAnalysis& a) {
  const fusion::Kernel& k = a.kernel;
  const fusion::LoopNest& nest = a.nest;
  const size_t loops = nest.loops.size();
  if (loops == 0) return 1;
  const size_t inner = loops - 1;
  int width = 8;
  bool any = false;
  std::vector<std::pair<const std::vector<int64_t>*, int64_t>> contiguous;  // strides, offset
  struct Edge {
    const std::vector<int64_t>* strides;
    int64_t offset, extent;
  };
  std::vector<Edge> edges;  // the bounds that move along the innermost loop
  for (size_t i = 0; i < k.exprs.size(); ++i) {
    const Expr& e = k.exprs[i];
    if (fusion::Kernel::is_gathered(e)) return 1;
    if (e.kind == ExprKind::InBounds) {
      for (size_t b = 0; b < e.bounds.size(); ++b) {
        const std::vector<int64_t>& strides = nest.bound_strides[i][b];
        if (strides[inner] == 0) continue;
        if (strides[inner] != 1) return 1;
        edges.push_back({&strides, e.bounds[b].index.offset, e.bounds[b].extent});
      }
      continue;
    }
    if (e.kind != ExprKind::Load) continue;
    const int64_t stride = nest.load_strides[i][inner];
    if (stride != 0 && stride != 1) return 1;
    if (stride != 1) continue;
    width = std::min(width, 16 / type_info(k.buffers[e.buffer].dtype).bytes);
    contiguous.push_back({&nest.load_strides[i], e.index.offset});
    any = true;
  }
  for (size_t s = 0; s < k.stores.size(); ++s) {
    if (nest.store_strides[s][inner] != 1) return 1;
    width = std::min(width, 16 / type_info(k.buffers[k.stores[s].buffer].dtype).bytes);
    contiguous.push_back({&nest.store_strides[s], k.stores[s].index.offset});
    any = true;
  }
  if (!any || width < 2) return 1;
  for (; width >= 2; width /= 2) {
    bool fits = true;
    for (const Edge& edge : edges) {
      fits = fits && edge.offset % width == 0 && edge.extent % width == 0;
      for (size_t l = 0; l < inner; ++l) fits = fits && (*edge.strides)[l] % width == 0;
    }
    if (loops == 1) {
      if (fits) return width;
      continue;
    }
    fits = fits && nest.loops[inner].size % width == 0;
    for (const auto& [strides, offset] : contiguous) {
      fits = fits && offset % width == 0;
      for (size_t l = 0; l < inner; ++l) fits = fits && (*strides)[l] % width == 0;
    }
    if (fits) return width;
  }
  return 1;
}

}  // namespace

CudaKernelSchedule schedule_pointwise(const KernelAnalysis& a) {
  CudaKernelSchedule s;
  s.kind = CudaKernelKind::Pointwise;
  s.vector_width = pointwise_vector_width(a);
  s.block_x = kPointwiseBlock;
  return s;
}

CudaKernelSchedule schedule_thread_per_row(const KernelAnalysis& a) {
  CudaKernelSchedule s;
  s.kind = CudaKernelKind::ThreadPerRow;
  s.block_x = kPointwiseBlock;
  return s;
}

}  // namespace kiln::codegen::cuda
