// codegen/cuda's schedulers on hand-built loop-IR kernels (torch-free): the dispatcher's choice of kind for a
// representative kernel of each, the parameters each kind's scheduler decides, and the strategy names.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "codegen/cuda/kernel_schedule.h"

using kiln::codegen::cuda::CudaKernelKind;
using kiln::codegen::cuda::CudaKernelSchedule;
using kiln::codegen::cuda::KernelAnalysis;
using kiln::codegen::cuda::schedule_cuda_kernel;
using kiln::codegen::cuda::strategy_name;
using kiln::decomp::PrimOp;
using kiln::decomp::ReduceOp;
using kiln::fusion::Expr;
using kiln::fusion::ExprKind;
using kiln::fusion::Kernel;
using kiln::graph::ScalarType;

namespace {

// A kernel over `domain` (dims marked in `reduced`) reading buffer 0 and writing buffer 1, both of `dtype`.
Kernel kernel(std::vector<int64_t> domain, std::vector<bool> reduced, ScalarType dtype = ScalarType::Float) {
  Kernel k;
  k.name = "kernel_test";
  k.domain = std::move(domain);
  k.reduced = std::move(reduced);
  k.buffers = {{0, dtype, false}, {1, dtype, true}};
  return k;
}

int32_t add(Kernel& k, Expr e) {
  k.exprs.push_back(std::move(e));
  return static_cast<int32_t>(k.exprs.size()) - 1;
}

int32_t load(Kernel& k, std::vector<int64_t> strides) {
  Expr e{ExprKind::Load, k.buffers[0].dtype};
  e.buffer = 0;
  e.index.strides = std::move(strides);
  return add(k, e);
}

int32_t reduce(Kernel& k, int32_t operand, ReduceOp op = ReduceOp::Sum) {
  Expr e{ExprKind::Reduce, k.exprs[operand].dtype};
  e.reduce_op = op;
  e.operands[0] = operand;
  return add(k, e);
}

int32_t binary(Kernel& k, PrimOp op, int32_t a, int32_t b) {
  Expr e{ExprKind::Binary, k.exprs[a].dtype};
  e.op = op;
  e.operands[0] = a;
  e.operands[1] = b;
  return add(k, e);
}

void store(Kernel& k, int32_t expr, std::vector<int64_t> strides) { k.stores.push_back({1, expr, {0, std::move(strides)}}); }

// `n` contiguous elements, `x * 2` each.
Kernel pointwise(int64_t n, ScalarType dtype = ScalarType::Float) {
  Kernel k = kernel({n}, {false}, dtype);
  store(k, binary(k, PrimOp::Mul, load(k, {1}), load(k, {1})), {1});
  return k;
}

// One sum per row of a contiguous rows x length matrix; `along`: also a store of x - sum along the row (a second
// pass over it).
Kernel row_sums(int64_t rows, int64_t length, bool along = false) {
  Kernel k = kernel({rows, length}, {false, true});
  const int32_t x = load(k, {length, 1});
  const int32_t sum = reduce(k, x);
  if (along) {
    store(k, binary(k, PrimOp::Sub, x, sum), {length, 1});
  } else {
    store(k, sum, {1, 0});
  }
  return k;
}

CudaKernelSchedule schedule(const Kernel& k) { return schedule_cuda_kernel(KernelAnalysis(k)); }

}  // namespace

TEST_CASE("pointwise kernels move 16-byte vectors where every access is contiguous", "[cuda_schedule]") {
  const CudaKernelSchedule s = schedule(pointwise(1024));
  CHECK(s.kind == CudaKernelKind::Pointwise);
  CHECK(s.vector_width == 4);
  CHECK(strategy_name(s) == "pointwise_vec4");
  CHECK(s.block_x == 256);
  CHECK(s.block_y == 1);
  CHECK(s.grid == 1);  // 256 vectors
  CHECK_FALSE(s.index_64bit);
  CHECK(strategy_name(schedule(pointwise(1024, ScalarType::Double))) == "pointwise_vec2");
  CHECK(strategy_name(schedule(pointwise(1024, ScalarType::Half))) == "pointwise_vec8");

  Kernel strided = kernel({1024}, {false});
  store(strided, load(strided, {2}), {1});
  CHECK(strategy_name(schedule(strided)) == "pointwise");
}

TEST_CASE("the grid stops at kMaxGrid blocks, indices widen past 2^31, empty domains launch nothing", "[cuda_schedule]") {
  const CudaKernelSchedule big = schedule(pointwise(int64_t{1} << 31));
  CHECK(big.grid == (1u << 20));
  CHECK(big.index_64bit);
  CHECK(schedule(pointwise(0)).grid == 0);
}

TEST_CASE("short rows take a warp each, eight rows per block", "[cuda_schedule]") {
  const CudaKernelSchedule s = schedule(row_sums(100, 100));
  CHECK(s.kind == CudaKernelKind::WarpPerRow);
  CHECK(strategy_name(s) == "warp_per_row");
  CHECK(s.block_x == 32);
  CHECK(s.block_y == 8);
  CHECK(s.rows_per_block == 8);
  CHECK(s.grid == 13);
  CHECK(s.row_vector_width == 2);  // 100 elements: not 32 vectors of 4
  CHECK(s.cached_row_chunks == 0);  // one pass
}

TEST_CASE("long rows take a block each; several passes over a row that fits in registers cache it", "[cuda_schedule]") {
  const CudaKernelSchedule s = schedule(row_sums(64, 1024));
  CHECK(s.kind == CudaKernelKind::BlockPerRow);
  CHECK(strategy_name(s) == "block_per_row");
  CHECK(s.rows_per_block == 1);
  CHECK(s.row_vector_width == 4);
  CHECK(s.block_x == 256);  // 256 vectors of 4, one step
  CHECK(s.grid == 64);

  const CudaKernelSchedule cached = schedule(row_sums(64, 1024, /*along=*/true));
  CHECK(strategy_name(cached) == "block_per_row_cached");
  CHECK(cached.cached_row_chunks == 1);
  CHECK(strategy_name(schedule(row_sums(8, 100, /*along=*/true))) == "warp_per_row_cached");

  Kernel strided = kernel({4, 4096}, {false, true});  // every other element: scalar passes, about 4 each
  store(strided, reduce(strided, load(strided, {8192, 2})), {1, 0});
  const CudaKernelSchedule scalar = schedule(strided);
  CHECK(strategy_name(scalar) == "block_per_row");
  CHECK(scalar.row_vector_width == 1);
  CHECK(scalar.block_x == 1024);
}

TEST_CASE("sums over the rows of a matrix take the column kind", "[cuda_schedule]") {
  Kernel k = kernel({300, 40}, {true, false});  // a bias gradient: 40 columns, 300 rows
  store(k, reduce(k, load(k, {40, 1})), {0, 1});
  const CudaKernelSchedule s = schedule(k);
  CHECK(s.kind == CudaKernelKind::Column);
  CHECK(strategy_name(s) == "column");
  CHECK(s.column_width == 8);  // few columns: narrow blocks
  CHECK(s.block_x == 8);
  CHECK(s.block_y == 64);      // as many threads along the rows as 300 rows allow (4 rows each at least)
  CHECK(s.grid == 5);
  CHECK(s.column_vector_width == 1);

  Kernel wide = kernel({16, 65536}, {true, false});  // enough outputs for 4 columns per thread
  store(wide, reduce(wide, load(wide, {65536, 1})), {0, 1});
  const CudaKernelSchedule v = schedule(wide);
  CHECK(v.column_vector_width == 4);
  CHECK(v.column_width == 32);
  CHECK(v.grid == 512);
}

TEST_CASE("a column kernel without outputs launches nothing", "[cuda_schedule]") {
  Kernel k = kernel({3, 0, 4}, {true, false, false});  // x.sum(0) of a 3x0x4 tensor
  store(k, reduce(k, load(k, {4, 4, 1})), {0, 4, 1});
  const CudaKernelSchedule s = schedule(k);
  CHECK(s.kind == CudaKernelKind::Column);
  CHECK(s.grid == 0);
}

TEST_CASE("small pooling windows take a thread per output", "[cuda_schedule]") {
  Kernel k = kernel({1000, 9}, {false, true});
  k.window_reduction = true;
  store(k, reduce(k, load(k, {9, 1}), ReduceOp::Max), {1, 0});
  const CudaKernelSchedule s = schedule(k);
  CHECK(s.kind == CudaKernelKind::ThreadPerRow);
  CHECK(strategy_name(s) == "thread_per_row");
  CHECK(s.block_x == 256);
  CHECK(s.grid == 4);
}
