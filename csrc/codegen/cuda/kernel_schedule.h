#pragma once
/// The CUDA schedulers: how one fused kernel of the loop IR maps onto threads, decided before any code is written,
/// as nvFuser's schedulers hand their parameters to its code generator. `schedule_cuda_kernel` picks the kernel's
/// kind from one table (kernel_schedule.cpp) and calls that kind's scheduler (schedule_pointwise.cpp,
/// schedule_row_reductions.cpp, schedule_column_reduction.cpp); KernelEmitter (kernel_emitter.h) only renders the
/// CudaKernelSchedule it returns. The schedulers are CUDA's: fusion/ stays device-neutral.
///
/// Needs: a verified kernel (fusion::verify_kernel). Guarantees: a kind whose code the emitter can write for the
/// kernel, and a launch (grid, block) that the kernel's grid-stride loops accept. Torch-free.
#include <cstdint>
#include <string>
#include <vector>

#include "fusion/loop_nest.h"

namespace kiln::codegen::cuda {

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

/// How a kernel's outputs map onto threads. The launch's strategy string names it (strategy_name).
enum class CudaKernelKind : uint8_t {
  Pointwise,     ///< no reduction: one thread per element, or per vector of elements
  ThreadPerRow,  ///< a small window per output (pooling): one thread walks it serially
  Column,        ///< accesses contiguous along the outputs: neighbouring outputs per block, threadIdx.y splits rows
  WarpPerRow,    ///< rows up to kWarpRowLimit elements: one warp per row, lanes combined by shuffles
  BlockPerRow,   ///< longer rows: one block per row, combined through shared memory
};

/// A kernel with the facts about its loops that the schedulers and the emitter both read.
struct KernelAnalysis {
  explicit KernelAnalysis(const fusion::Kernel& k);

  const fusion::Kernel& kernel;
  fusion::LoopNest nest;
  std::vector<bool> depends;          ///< fusion::depends_on_reduced_loops
  std::vector<bool> uses_reductions;  ///< fusion::uses_reductions

  /// A reduction expression or a reduced loop: the kernel is not pointwise.
  bool reduces() const;
  /// Store s writes along the reduced loops (a value per element, not one per output).
  bool store_along_reduced(size_t s) const;
  bool contiguous_along_reduced(const std::vector<int64_t>& strides) const {
    return strides.back() == 1 && nest.runs_reduced(strides);
  }
};

/// Everything decided about a kernel before its code is written; the emitter reads nothing else to choose.
struct CudaKernelSchedule {
  CudaKernelKind kind = CudaKernelKind::Pointwise;
  unsigned grid = 0;     ///< blocks (0: an empty domain, nothing to launch)
  unsigned block_x = 1;  ///< threads per block along x (Column: along the columns)
  unsigned block_y = 1;  ///< WarpPerRow: rows per block; Column: threads along the rows
  /// Pointwise: elements per thread and access (16-byte vectors along the innermost loop), or 1.
  int vector_width = 1;
  /// WarpPerRow, BlockPerRow: rows each block owns (one per warp, or the block's one row).
  unsigned rows_per_block = 1;
  /// WarpPerRow, BlockPerRow: elements per lane and step of the row passes where the alignment test passes, or 1.
  int row_vector_width = 1;
  /// WarpPerRow, BlockPerRow, vector passes: each thread's vectors per load, read into registers once before the
  /// passes (cached rows), or 0 where every pass reads memory.
  int cached_row_chunks = 0;
  /// Column: threads along the columns per block (block_x), and neighbouring columns per thread (vector accesses
  /// where the alignment test passes), or 1.
  int column_width = 32;
  int column_vector_width = 1;
  /// 64-bit index arithmetic: some index, or a loop index plus its grid-stride step, could reach 2^31 - 1.
  bool index_64bit = false;

  unsigned threads_per_block() const { return block_x * block_y; }
  bool operator==(const CudaKernelSchedule&) const = default;
};

/// The kernel's kind (the first row of the dispatcher table whose condition holds), that kind's scheduler, then
/// finish_schedule.
CudaKernelSchedule schedule_cuda_kernel(const KernelAnalysis& a);

/// What every kind shares, derived from the parameters its scheduler (or a tuning candidate) chose: the grid
/// (launch_grid; no blocks for an empty domain) and the index width, which depends on the grid.
void finish_schedule(const KernelAnalysis& a, CudaKernelSchedule& s);

/// Blocks for the kind's unit of work (a pointwise vector or element, a row, a column group) at the schedule's block
/// shape, at most kMaxGrid: the kernels' grid-stride loops cover the rest.
unsigned launch_grid(const KernelAnalysis& a, const CudaKernelSchedule& s);

/// max-autotune: `chosen` (schedule_cuda_kernel's) first, then up to kMaxTuningCandidates - 1 distinct alternatives
/// of the same kind, each one the emitter renders correctly (block shapes the device helpers accept, grids and
/// index widths recomputed), fewest changes from `chosen` first. The runtime times them and keeps the fastest
/// (tune_candidates.cpp says which parameters vary and why). Only `chosen` for an empty domain.
std::vector<CudaKernelSchedule> tuning_candidates(const KernelAnalysis& a, const CudaKernelSchedule& chosen);
constexpr size_t kMaxTuningCandidates = 8;

/// The launch's strategy ("pointwise_vec4", "warp_per_row_cached", ...: logs, tests, compiled_graph_summary): the
/// kind's name from one table, with the pointwise vector width and `_cached` for cached rows.
std::string strategy_name(const CudaKernelSchedule& s);

// One scheduler per kind, each deciding only its own parameters and block shape (finish_schedule derives the grid).
// schedule_cuda_kernel's table calls them where their kind applies (kernel_schedule.cpp says when); they assume it
// does.
CudaKernelSchedule schedule_pointwise(const KernelAnalysis& a);
CudaKernelSchedule schedule_thread_per_row(const KernelAnalysis& a);
CudaKernelSchedule schedule_column(const KernelAnalysis& a);
CudaKernelSchedule schedule_warp_per_row(const KernelAnalysis& a);
CudaKernelSchedule schedule_block_per_row(const KernelAnalysis& a);

/// A reduction kernel whose accesses walk the innermost output loop contiguously and never the reduced loops: the
/// column kind. Its stores are one value per output, or values along the reduced loops that use no reduction (a
/// fused producer's result), made in the first reduction's walk.
bool column_shaped(const KernelAnalysis& a);

// The schedulers' rules that tuning candidates follow too (tune_candidates.cpp).
/// Cached rows: each thread's vectors per load for rows of `width`-element vectors over `threads_per_row` threads,
/// or 0 where the row passes read memory (one pass, or the row does not fit in registers).
int cached_row_chunks(const KernelAnalysis& a, int width, int64_t threads_per_row);
/// block_per_row's threads per row for vectors of `width` elements (a multiple of 32, at most 1024).
int64_t block_row_threads(const KernelAnalysis& a, int width);
/// The column kind's most threads along the rows for blocks `column_width` wide: a power of two (column_reduce's
/// tree), at most 1024 threads in all, and at least 4 rows each.
int64_t column_rows_limit(const KernelAnalysis& a, int column_width);

int64_t pow2_ceil(int64_t v);
int64_t pow2_floor(int64_t v);

}  // namespace kiln::codegen::cuda
