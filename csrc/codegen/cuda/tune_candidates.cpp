// Tuning candidates for mode="max-autotune" (kernel_schedule.h): alternative schedules of one kernel, which the
// runtime times on the GPU at the first call, keeping the fastest.
//
// Design: each kind varies only parameters its emitter renders correctly for any value in the set, so a candidate
// can never be wrong, only slower. The schedulers' fixed choices were measured on a few models (their comments say
// which); the sets below bracket those choices:
//   pointwise:      block_x in {128, 256, 512, 1024} x vector_width in {chosen, 1}. A narrower vector is always
//                   legal: the scheduler's width divides every stride and offset, and the kernel tests alignment at
//                   run time anyway.
//   thread_per_row: block_x in {128, 256, 512}.
//   warp_per_row:   rows per block in {2, 4, 8, 16}; with vectors also the uncached rows and scalar passes.
//   block_per_row:  threads per row in {chosen, 128, 256, 512, 1024}, each with the cached rows recomputed for it
//                   (chunks must cover the row); scalar passes at their own thread count; the uncached rows.
//   column:         column_width in {8, 16, 32} x threads along the rows in {chosen / 2, chosen, chosen * 2}
//                   (powers of two within column_rows_limit, as column_reduce needs) x column_vector_width in
//                   {chosen, 1}.
// Combinations are ordered by how many parameters differ from the chosen schedule, so that the cap of
// kMaxTuningCandidates keeps every single change before any pair. The order depends on nothing but the kernel.
#include <algorithm>
#include <vector>

#include "codegen/cuda/kernel_schedule.h"
#include "common/error.h"

namespace kiln::codegen::cuda {

namespace {

// Every combination of one index per axis (index 0: the chosen schedule's value), fewest non-zero indices first,
// in order of the axes otherwise.
std::vector<std::vector<size_t>> combinations(const std::vector<size_t>& axis_sizes) {
  std::vector<std::vector<size_t>> all{{}};
  for (size_t size : axis_sizes) {
    std::vector<std::vector<size_t>> longer;
    for (const auto& prefix : all)
      for (size_t i = 0; i < size; ++i) {
        longer.push_back(prefix);
        longer.back().push_back(i);
      }
    all = std::move(longer);
  }
  auto changes = [](const std::vector<size_t>& c) { return std::count_if(c.begin(), c.end(), [](size_t i) { return i != 0; }); };
  std::stable_sort(all.begin(), all.end(), [&](const auto& x, const auto& y) { return changes(x) < changes(y); });
  return all;
}

// `values` with `first` in front and no repeats.
template <typename T>
std::vector<T> chosen_first(T first, const std::vector<T>& values) {
  std::vector<T> out{first};
  for (const T& v : values)
    if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
  return out;
}

// What the device helpers and the emitter need of a block: kiln_reduce.cuh's block_reduce wants whole warps,
// column_reduce a power of two along y and one shared word per thread, every launch at most 1024 threads.
bool renderable(const CudaKernelSchedule& s) {
  if (s.threads_per_block() == 0 || s.threads_per_block() > 1024) return false;
  switch (s.kind) {
    case CudaKernelKind::BlockPerRow:
      return s.block_x % 32 == 0 && s.block_y == 1;
    case CudaKernelKind::WarpPerRow:
      return s.block_x == 32 && s.block_y == s.rows_per_block;
    case CudaKernelKind::Column:
      return s.block_x == static_cast<unsigned>(s.column_width) && pow2_floor(s.block_y) == s.block_y;
    case CudaKernelKind::Pointwise:
    case CudaKernelKind::ThreadPerRow:
      return s.block_y == 1;
  }
  return false;
}

}  // namespace

std::vector<CudaKernelSchedule> tuning_candidates(const KernelAnalysis& a, const CudaKernelSchedule& chosen) {
  std::vector<CudaKernelSchedule> out{chosen};
  if (chosen.grid == 0) return out;  // an empty domain launches nothing: nothing to time
  auto add = [&](CudaKernelSchedule s) {
    if (out.size() >= kMaxTuningCandidates) return;
    finish_schedule(a, s);
    KILN_ASSERT(renderable(s)) << "kernel " << a.kernel.name << ": tuning candidate " << strategy_name(s) << " with block ("
                               << s.block_x << ", " << s.block_y << ")";
    if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
  };
  switch (chosen.kind) {
    case CudaKernelKind::Pointwise: {
      const auto blocks = chosen_first<unsigned>(chosen.block_x, {128, 256, 512, 1024});
      const auto widths = chosen_first<int>(chosen.vector_width, {1});
      for (const auto& c : combinations({blocks.size(), widths.size()})) {
        CudaKernelSchedule s = chosen;
        s.block_x = blocks[c[0]];
        s.vector_width = widths[c[1]];
        add(s);
      }
      break;
    }
    case CudaKernelKind::ThreadPerRow:
      for (unsigned block : {128u, 256u, 512u}) {
        CudaKernelSchedule s = chosen;
        s.block_x = block;
        add(s);
      }
      break;
    case CudaKernelKind::WarpPerRow: {
      for (unsigned rows : {2u, 4u, 8u, 16u}) {
        CudaKernelSchedule s = chosen;
        s.rows_per_block = s.block_y = rows;
        add(s);
      }
      CudaKernelSchedule uncached = chosen;
      uncached.cached_row_chunks = 0;
      add(uncached);
      uncached.row_vector_width = 1;
      add(uncached);
      break;
    }
    case CudaKernelKind::BlockPerRow: {
      for (unsigned threads : {128u, 256u, 512u, 1024u}) {
        CudaKernelSchedule s = chosen;
        s.block_x = threads;
        s.cached_row_chunks = cached_row_chunks(a, s.row_vector_width, threads);
        add(s);
      }
      CudaKernelSchedule scalar = chosen;
      scalar.row_vector_width = 1;
      scalar.cached_row_chunks = 0;
      scalar.block_x = static_cast<unsigned>(block_row_threads(a, 1));
      add(scalar);
      CudaKernelSchedule uncached = chosen;
      uncached.cached_row_chunks = 0;
      add(uncached);
      break;
    }
    case CudaKernelKind::Column: {
      const auto widths = chosen_first<int>(chosen.column_width, {8, 16, 32});
      const auto depths = chosen_first<unsigned>(chosen.block_y, {std::max(chosen.block_y / 2, 1u), chosen.block_y * 2});
      const auto vectors = chosen_first<int>(chosen.column_vector_width, {1});
      for (const auto& c : combinations({widths.size(), depths.size(), vectors.size()})) {
        CudaKernelSchedule s = chosen;
        s.column_width = widths[c[0]];
        s.block_x = static_cast<unsigned>(s.column_width);
        s.block_y = static_cast<unsigned>(std::clamp<int64_t>(depths[c[1]], 1, column_rows_limit(a, s.column_width)));
        s.column_vector_width = vectors[c[2]];
        add(s);
      }
      break;
    }
  }
  return out;
}

}  // namespace kiln::codegen::cuda
