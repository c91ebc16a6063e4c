// codegen/cuda's schedulers on hand-built loop-IR kernels (torch-free): the dispatcher's choice of kind for a
// representative kernel of each, the parameters each kind's scheduler decides, and the strategy names; max-autotune's
// tuning candidates of each kind and their variants in the emitted source.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "codegen/cuda/emit_cuda.h"
#include "codegen/cuda/kernel_schedule.h"

using kiln::codegen::cuda::CudaKernelKind;
using kiln::codegen::cuda::CudaKernelSchedule;
using kiln::codegen::cuda::KernelAnalysis;
using kiln::codegen::cuda::emit_cuda_source;
using kiln::codegen::cuda::schedule_cuda_kernel;
using kiln::codegen::cuda::strategy_name;
using kiln::codegen::cuda::tuning_candidates;
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

// A 9-element max pooling window per output, 1000 outputs.
Kernel pooling() {
  Kernel k = kernel({1000, 9}, {false, true});
  k.window_reduction = true;
  store(k, reduce(k, load(k, {9, 1}), ReduceOp::Max), {1, 0});
  return k;
}

// Column sums of a rows x columns matrix (a bias gradient).
Kernel column_sums(int64_t rows, int64_t columns) {
  Kernel k = kernel({rows, columns}, {true, false});
  store(k, reduce(k, load(k, {columns, 1})), {0, 1});
  return k;
}

Kernel named(Kernel k, const std::string& name) {
  k.name = name;
  return k;
}

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

namespace {

// The candidates of `k` with what every kind must keep: the chosen schedule first, no repeats, at most
// kMaxTuningCandidates, the same kind, blocks the device helpers accept, and a grid covering the work.
std::vector<CudaKernelSchedule> checked_candidates(const Kernel& k) {
  const KernelAnalysis a(k);
  const CudaKernelSchedule chosen = schedule_cuda_kernel(a);
  const std::vector<CudaKernelSchedule> c = tuning_candidates(a, chosen);
  REQUIRE(!c.empty());
  CHECK(c[0] == chosen);
  CHECK(c.size() <= kiln::codegen::cuda::kMaxTuningCandidates);
  CHECK(tuning_candidates(a, chosen) == c);  // deterministic
  const int64_t outer = a.nest.outer_numel(), reduced = a.nest.reduced_numel();
  for (size_t i = 0; i < c.size(); ++i) {
    const CudaKernelSchedule& s = c[i];
    INFO("candidate " << i << ": " << strategy_name(s) << " block (" << s.block_x << ", " << s.block_y << ")");
    for (size_t j = 0; j < i; ++j) CHECK_FALSE(c[j] == s);
    CHECK(s.kind == chosen.kind);
    CHECK(s.threads_per_block() <= 1024);
    CHECK(s.threads_per_block() >= 1);
    int64_t covered = 0;  // outputs the grid's first trip covers
    switch (s.kind) {
      case CudaKernelKind::Pointwise:
      case CudaKernelKind::ThreadPerRow:
        CHECK(s.block_y == 1);
        covered = int64_t{s.grid} * s.block_x * s.vector_width;
        break;
      case CudaKernelKind::Column:
        CHECK(s.block_x == static_cast<unsigned>(s.column_width));
        CHECK((s.column_width == 8 || s.column_width == 16 || s.column_width == 32));
        CHECK((s.block_y & (s.block_y - 1)) == 0);  // column_reduce's tree
        covered = int64_t{s.grid} * s.column_width * s.column_vector_width;
        break;
      case CudaKernelKind::WarpPerRow:
        CHECK(s.block_x == 32);
        CHECK(s.block_y == s.rows_per_block);
        covered = int64_t{s.grid} * s.rows_per_block;
        break;
      case CudaKernelKind::BlockPerRow:
        CHECK(s.block_x % 32 == 0);  // block_reduce: whole warps
        CHECK(s.block_y == 1);
        covered = s.grid;
        break;
    }
    CHECK((covered >= outer || s.grid == (1u << 20)));
    if (s.cached_row_chunks > 0)  // the cached steps reach the end of the row
      CHECK(int64_t{s.cached_row_chunks} * s.block_x * s.row_vector_width >= reduced);
    if (s.row_vector_width == 1) CHECK(s.cached_row_chunks == 0);
  }
  return c;
}

bool has(const std::vector<CudaKernelSchedule>& c, auto&& pred) { return std::any_of(c.begin(), c.end(), pred); }

}  // namespace

TEST_CASE("tuning candidates of every kind start with the chosen schedule and stay renderable", "[cuda_schedule]") {
  SECTION("pointwise: four block sizes, with and without vectors") {
    const auto c = checked_candidates(pointwise(1 << 20));
    CHECK(c.size() == 8);
    CHECK(has(c, [](const CudaKernelSchedule& s) { return s.block_x == 1024 && s.vector_width == 1; }));
    Kernel strided = kernel({1024}, {false});
    store(strided, load(strided, {2}), {1});
    CHECK(checked_candidates(strided).size() == 4);  // scalar already
  }
  SECTION("thread_per_row: three block sizes") {
    const auto c = checked_candidates(pooling());
    CHECK(c.size() == 3);
    CHECK(c[0].block_x == 256);
  }
  SECTION("warp_per_row: rows per block, uncached and scalar rows") {
    const auto c = checked_candidates(row_sums(8, 100, /*along=*/true));
    CHECK(c[0].cached_row_chunks > 0);
    CHECK(c.size() == 6);
    CHECK(has(c, [](const CudaKernelSchedule& s) { return s.rows_per_block == 2; }));
    CHECK(has(c, [](const CudaKernelSchedule& s) { return s.row_vector_width > 1 && s.cached_row_chunks == 0; }));
    CHECK(has(c, [](const CudaKernelSchedule& s) { return s.row_vector_width == 1; }));
    CHECK(checked_candidates(row_sums(100, 100)).size() == 5);  // one pass: never cached
  }
  SECTION("block_per_row: threads per row with the cache recomputed, scalar and uncached rows") {
    const auto c = checked_candidates(row_sums(64, 1024, /*along=*/true));
    CHECK(c[0].cached_row_chunks == 1);
    CHECK(has(c, [](const CudaKernelSchedule& s) { return s.block_x == 128 && s.cached_row_chunks == 2; }));
    CHECK(has(c, [](const CudaKernelSchedule& s) { return s.row_vector_width == 1 && s.block_x == 256; }));
    CHECK(has(c, [](const CudaKernelSchedule& s) { return s.block_x == 256 && s.row_vector_width == 4 && s.cached_row_chunks == 0; }));
    Kernel strided = kernel({4, 4096}, {false, true});
    store(strided, reduce(strided, load(strided, {8192, 2})), {1, 0});
    checked_candidates(strided);
  }
  SECTION("column: widths, depths and vectors, single changes first") {
    // width 8 with 64 threads along the rows (4 rows each at most: never 128), the other widths at that depth (32
    // for width 32: 1024 threads) and at half of it
    const auto c = checked_candidates(column_sums(300, 40));
    REQUIRE(c.size() == 5);
    CHECK((c[1].column_width == 8 && c[1].block_y == 32));
    CHECK((c[2].column_width == 16 && c[2].block_y == 64));
    CHECK((c[3].column_width == 32 && c[3].block_y == 32));
    CHECK((c[4].column_width == 16 && c[4].block_y == 32));
    const auto v = checked_candidates(column_sums(16, 65536));
    CHECK(v[0].column_vector_width == 4);
    CHECK(has(v, [](const CudaKernelSchedule& s) { return s.column_vector_width == 1; }));
  }
  SECTION("an empty domain has nothing to time") {
    CHECK(checked_candidates(pointwise(0)).size() == 1);
    Kernel k = kernel({3, 0, 4}, {true, false, false});
    store(k, reduce(k, load(k, {4, 4, 1})), {0, 4, 1});
    CHECK(checked_candidates(k).size() == 1);
  }
}

TEST_CASE("tuned sources carry every kernel's variants beside it, keyed by their code", "[cuda_schedule]") {
  kiln::graph::Graph g;
  kiln::fusion::Schedule schedule;
  // kernel_2 is kernel_0's twin (the same code under another name)
  schedule.kernels = {named(row_sums(64, 1024, true), "kernel_0_norm"), named(pointwise(4096), "kernel_1_mul"),
                      named(row_sums(64, 1024, true), "kernel_2_norm"), named(column_sums(300, 40), "kernel_3_sum")};
  const auto plain = emit_cuda_source(schedule, g);
  const auto untuned = emit_cuda_source(schedule, g, {}, false, /*tune=*/false);
  CHECK(untuned.parts == plain.parts);
  for (const auto& launch : plain.kernels) {
    CHECK(launch.variants.empty());
    CHECK(launch.tune_key.empty());
  }
  CHECK(plain.source.find("_t1(") == std::string::npos);

  const auto tuned = emit_cuda_source(schedule, g, {}, false, /*tune=*/true);
  REQUIRE(tuned.kernels.size() == 4);
  CHECK(tuned.parts.size() == plain.parts.size());  // variants join their default's part
  for (size_t i : {0u, 1u, 3u}) {
    const auto& launch = tuned.kernels[i];
    INFO(launch.name);
    CHECK(launch.name == plain.kernels[i].name);
    CHECK(launch.grid == plain.kernels[i].grid);
    CHECK(launch.part == plain.kernels[i].part);
    REQUIRE(launch.variants.size() >= 2);
    CHECK(launch.tune_key.size() == 64);
    for (size_t v = 0; v < launch.variants.size(); ++v) {
      const auto& variant = launch.variants[v];
      CHECK(variant.name == launch.name + "_t" + std::to_string(v + 1));
      CHECK(variant.part == launch.part);
      CHECK(variant.variants.empty());
      CHECK(variant.tune_key.empty());
      CHECK(variant.grid > 0);
      const std::string signature = "__launch_bounds__(" + std::to_string(variant.block_x * variant.block_y) + ") " + variant.name + "(";
      CHECK(tuned.parts[launch.part].find(signature) != std::string::npos);
    }
  }
  // The twin launches its original's code and variants, under their names.
  const auto& twin = tuned.kernels[2];
  CHECK(twin.name == "kernel_0_norm");
  REQUIRE(twin.variants.size() == tuned.kernels[0].variants.size());
  CHECK(twin.variants[0].name == "kernel_0_norm_t1");
  CHECK(twin.tune_key == tuned.kernels[0].tune_key);
  CHECK(tuned.source.find("kernel_2_norm_t1(") == std::string::npos);
  // Keys: stable across emits, different for different kernels, the same for the same kernel in another graph.
  const auto again = emit_cuda_source(schedule, g, {}, false, true);
  CHECK(again.parts == tuned.parts);
  for (size_t i = 0; i < 4; ++i) CHECK(again.kernels[i].tune_key == tuned.kernels[i].tune_key);
  CHECK(tuned.kernels[0].tune_key != tuned.kernels[1].tune_key);
  CHECK(tuned.kernels[1].tune_key != tuned.kernels[3].tune_key);
  kiln::fusion::Schedule other;
  other.kernels = {named(pointwise(4096), "kernel_7_scale")};
  CHECK(emit_cuda_source(other, g, {}, false, true).kernels[0].tune_key == tuned.kernels[1].tune_key);
  other.kernels = {named(pointwise(8192), "kernel_1_mul")};
  CHECK(emit_cuda_source(other, g, {}, false, true).kernels[0].tune_key != tuned.kernels[1].tune_key);
}
