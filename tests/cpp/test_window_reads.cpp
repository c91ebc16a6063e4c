// fusion/window_reads and the scheduler on padded and pooled reads, on hand-built CPU graphs (torch-free):
// index composition, which dims get bounds, the pool's window kernel, a producer recomputed per window element,
// and guarded loads in both code generators' text. Then the other index arithmetic of the loop IR: scatters with
// one index per slice (decomp/decompose_gather.cpp), an iota compared with a checked index.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>

#include "codegen/cpp/emit_cpp.h"
#include "codegen/cuda/emit_cuda.h"
#include "fusion/loop_nest.h"
#include "fusion/schedule_kernels.h"
#include "fusion/window_reads.h"
#include "graph/graph.h"

using namespace kiln::graph;
using kiln::decomp::DimAccess;
using kiln::decomp::PrimOp;
using kiln::fusion::ExprKind;
using kiln::fusion::IndexExpr;
using kiln::fusion::WindowMap;

namespace {
TensorMeta cpu(std::vector<int64_t> sizes, std::vector<int64_t> strides = {}, ScalarType dtype = ScalarType::Float) {
  TensorMeta m;
  m.strides = strides.empty() ? contiguous_strides(sizes) : std::move(strides);
  m.sizes = std::move(sizes);
  m.dtype = dtype;
  return m;
}

Node op(const std::string& name, const std::string& overload, std::vector<ArgValue> args, std::vector<std::string> names) {
  Node n;
  n.op = name;
  n.overload = overload;
  n.args = std::move(args);
  n.arg_names = std::move(names);
  n.num_positional = static_cast<int32_t>(n.args.size());
  return n;
}

// max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1], [1, 1], False) on [2, 4, 9, 9] -> [2, 4, 5, 5]; `layout`
// strides for the input and output ("nchw" or channels-last).
ValueId max_pool(Graph& g, ValueId x, bool channels_last) {
  const auto out_strides = channels_last ? std::vector<int64_t>{100, 1, 20, 4} : std::vector<int64_t>{};
  return g.add_node(op("aten::max_pool2d_with_indices", "default",
                       {TensorArg{x}, std::vector<int64_t>{3, 3}, std::vector<int64_t>{2, 2}, std::vector<int64_t>{1, 1},
                        std::vector<int64_t>{1, 1}, false},
                       {"self", "kernel_size", "stride", "padding", "dilation", "ceil_mode"}),
                    {cpu({2, 4, 5, 5}, out_strides), cpu({2, 4, 5, 5}, out_strides)})[0];
}

WindowMap pool_map() {
  WindowMap m;
  m.dims = {DimAccess{}, DimAccess{}, DimAccess{2, -1, 0, 1}, DimAccess{2, -1, 1, 1}};
  m.out_dims = {0, 1, 2, 3};
  m.window_dims = {4, 5};
  m.domain = {2, 4, 5, 5, 3, 3};
  return m;
}

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}
}  // namespace

TEST_CASE("a windowed read composes strides over output and window dims") {
  const WindowMap m = pool_map();
  IndexExpr source;
  source.offset = 5;
  source.strides = {324, 81, 9, 1};
  const IndexExpr composed = m.compose(source);
  CHECK(composed.offset == 5 - 9 - 1);  // the padding's -1 in H (stride 9) and W (stride 1)
  CHECK(composed.strides == std::vector<int64_t>{324, 81, 18, 2, 9, 1});
}

TEST_CASE("only dims whose index can leave the source get a bound") {
  const WindowMap m = pool_map();
  CHECK(m.bounded_dims({2, 4, 9, 9}) == std::vector<bool>{false, false, true, true});
  const auto bounds = m.bounds({2, 4, 9, 9});
  REQUIRE(bounds.size() == 2);
  CHECK(bounds[0].extent == 9);
  CHECK(bounds[0].index.offset == -1);
  CHECK(bounds[0].index.strides == std::vector<int64_t>{0, 0, 2, 0, 1, 0});
  // Without padding, a 3x3 / 2 window over 11 rows stays inside: no bound at all.
  WindowMap inside = pool_map();
  inside.dims[2].offset = inside.dims[3].offset = 0;
  CHECK(inside.bounds({2, 4, 11, 11}).empty());
  CHECK(inside.bounds({2, 4, 10, 11}).size() == 1);  // the last window of 10 rows would read row 10
}

TEST_CASE("max pool becomes one window kernel with guarded loads and a max over the window") {
  for (bool channels_last : {false, true}) {
    Graph g;
    const auto in_strides = channels_last ? std::vector<int64_t>{324, 1, 36, 4} : std::vector<int64_t>{};
    ValueId x = g.add_input(cpu({2, 4, 9, 9}, in_strides));
    g.set_outputs({max_pool(g, x, channels_last)});
    const auto schedule = kiln::fusion::schedule_kernels(g);
    REQUIRE(schedule.kernels.size() == 1);
    const auto& k = schedule.kernels[0];
    CHECK(k.window_reduction);
    CHECK(k.domain == std::vector<int64_t>{2, 4, 5, 5, 3, 3});
    CHECK(k.reduced == std::vector<bool>{false, false, false, false, true, true});
    CHECK_NOTHROW(kiln::fusion::verify_kernel(k));
    int guarded = 0;
    for (const auto& e : k.exprs) guarded += e.kind == ExprKind::Load && e.operands[0] >= 0;
    CHECK(guarded == 1);
    // The loop nest keeps the bounded H and W loops apart; channels-last puts C innermost.
    const auto nest = kiln::fusion::build_loop_nest(k);
    CHECK(nest.outer_count == (channels_last ? 4 : 3));
    CHECK(nest.store_strides[0][nest.outer_count - 1] == 1);
    const std::string cpp = kiln::codegen::cpp::emit_cpp_kernel(k, g);
    CHECK(count(cpp, "-std::numeric_limits<float>::infinity()") == 2);  // the accumulator and the guarded fill
    CHECK(cpp.find(" >= 0 && ") != std::string::npos);
    const auto cuda = kiln::codegen::cuda::emit_cuda_source(schedule, g);
    CHECK(cuda.kernels[0].strategy == "thread_per_row");
    CHECK(cuda.source.find("? kiln::load(buf0[") != std::string::npos);
  }
}

TEST_CASE("a pointwise producer of the pooled value is recomputed per window element, not stored") {
  Graph g;
  ValueId x = g.add_input(cpu({2, 4, 9, 9}));
  ValueId r = g.add_node(op("aten::relu", "default", {TensorArg{x}}, {"self"}), {cpu({2, 4, 9, 9})})[0];
  g.set_outputs({max_pool(g, r, false)});
  const auto schedule = kiln::fusion::schedule_kernels(g);
  REQUIRE(schedule.steps.size() == 1);
  const auto& k = schedule.kernels[schedule.steps[0].index];
  CHECK(k.buffers.size() == 2);  // x in, the pooled values out: relu's result is never a buffer
  // relu's value selected against the max's fill where the window leaves the input
  bool filled = false;
  for (const auto& e : k.exprs)
    filled = filled || (e.kind == ExprKind::Where && k.exprs[e.operands[2]].kind == ExprKind::Constant &&
                        std::isinf(k.exprs[e.operands[2]].constant) && k.exprs[e.operands[0]].kind == ExprKind::InBounds);
  CHECK(filled);
  CHECK_NOTHROW(kiln::fusion::verify_kernel(k));
}

TEST_CASE("constant_pad_nd reads its input through a guard and fills the rest") {
  Graph g;
  ValueId x = g.add_input(cpu({3, 5}));
  ValueId p = g.add_node(op("aten::constant_pad_nd", "default", {TensorArg{x}, std::vector<int64_t>{2, -1, 1, 0}, 0.5},
                            {"self", "pad", "value"}),
                         {cpu({4, 6})})[0];
  g.set_outputs({p});
  const auto schedule = kiln::fusion::schedule_kernels(g);
  REQUIRE(schedule.kernels.size() == 1);
  const auto& k = schedule.kernels[0];
  CHECK_FALSE(k.has_reduction());
  REQUIRE(k.scalar_loads_only());
  const std::string cpp = kiln::codegen::cpp::emit_cpp_kernel(k, g);
  CHECK(cpp.find(": static_cast<float>(0.5))") != std::string::npos);
  // The row index starts one before the input (pad 1 on top); the column index two before it (pad 2 left).
  CHECK(cpp.find("-7 + INT64_C(5) * i0 + INT64_C(1) * i1") != std::string::npos);
}

namespace {
// scatter_add(new_zeros(...), dim, index, grad) of `sizes` with the index's size 1 along `dim`, as a gather's gradient
// is written, then a relu of it.
Graph scatter_graph(const std::vector<int64_t>& sizes, int64_t dim) {
  Graph g;
  std::vector<int64_t> slice = sizes;
  slice[dim] = 1;
  ValueId index = g.add_input(cpu(slice, {}, ScalarType::Long));
  ValueId grad = g.add_input(cpu(slice));
  ValueId zeros = g.add_node(op("aten::new_zeros", "default",
                                {TensorArg{grad}, sizes, NoneArg{}, NoneArg{}, NoneArg{}, NoneArg{}},
                                {"self", "size", "dtype", "layout", "device", "pin_memory"}),
                             {cpu(sizes)})[0];
  ValueId s = g.add_node(op("aten::scatter_add", "default", {TensorArg{zeros}, dim, TensorArg{index}, TensorArg{grad}},
                            {"self", "dim", "index", "src"}),
                         {cpu(sizes)})[0];
  g.set_outputs({g.add_node(op("aten::relu", "default", {TensorArg{s}}, {"self"}), {cpu(sizes)})[0]});
  return g;
}
}  // namespace

TEST_CASE("a scatter with one index per slice is one pointwise kernel over an iota and a checked index") {
  struct Case {
    std::vector<int64_t> sizes;
    int64_t dim;
    size_t loops;                       // after merging the dims every access walks alike
    std::vector<int64_t> iota_strides;  // over those loops
  };
  for (const Case& c : {Case{{4, 6}, 1, 2, {0, 1}}, Case{{5, 4}, 0, 2, {1, 0}}, Case{{2, 3, 8}, 2, 2, {0, 1}},
                        Case{{2, 3, 8}, 1, 3, {0, 1, 0}}}) {
    Graph g = scatter_graph(c.sizes, c.dim);
    const auto schedule = kiln::fusion::schedule_kernels(g);
    REQUIRE(schedule.steps.size() == 1);
    REQUIRE(schedule.kernels.size() == 1);
    const auto& k = schedule.kernels[0];
    CHECK_NOTHROW(kiln::fusion::verify_kernel(k));
    CHECK_FALSE(k.has_reduction());
    CHECK(k.checks_indices());
    CHECK_FALSE(k.scalar_loads_only());  // the index is compared, never an address: vector loads stay
    int iotas = 0, checks = 0;
    for (const auto& e : k.exprs) {
      iotas += e.kind == ExprKind::Iota;
      checks += e.kind == ExprKind::Binary && e.op == PrimOp::CheckedIndex;
    }
    CHECK(iotas == 1);
    CHECK(checks == 1);
    const auto nest = kiln::fusion::build_loop_nest(k);
    CHECK(nest.loops.size() == c.loops);
    for (size_t e = 0; e < k.exprs.size(); ++e)
      if (k.exprs[e].kind == ExprKind::Iota) CHECK(nest.load_strides[e] == c.iota_strides);
    const std::string cpp = kiln::codegen::cpp::emit_cpp_kernel(k, g);
    CHECK(cpp.find("kiln_gather_index(") != std::string::npos);
    CHECK(cpp.find("static_cast<int64_t>(0 + INT64_C(1) * i") != std::string::npos);
    const auto cuda = kiln::codegen::cuda::emit_cuda_source(schedule, g);
    CHECK(cuda.source.find("kiln::gather_index(") != std::string::npos);
  }
}

namespace {
// cat([a, b], -1) of [4, 8, first] and [4, 8, second], times 2.
Graph cat_graph(int64_t first, int64_t second, ScalarType dtype = ScalarType::Float) {
  Graph g;
  ValueId a = g.add_input(cpu({4, 8, first}, {}, dtype));
  ValueId b = g.add_input(cpu({4, 8, second}, {}, dtype));
  ValueId c = g.add_node(op("aten::cat", "default", {TensorListArg{{a, b}}, int64_t{-1}}, {"tensors", "dim"}),
                         {cpu({4, 8, first + second}, {}, dtype)})[0];
  ValueId twice = g.add_node(op("aten::mul", "Tensor", {TensorArg{c}, 2.0}, {"self", "other"}),
                             {cpu({4, 8, first + second}, {}, dtype)})[0];
  g.set_outputs({twice});
  return g;
}
}  // namespace

TEST_CASE("cat is one loop whose operands are guarded reads, vectors where each vector lies inside one operand") {
  const Graph g = cat_graph(32, 32);
  const auto schedule = kiln::fusion::schedule_kernels(g);
  REQUIRE(schedule.kernels.size() == 1);
  const auto& k = schedule.kernels[0];
  CHECK_NOTHROW(kiln::fusion::verify_kernel(k));
  int guarded = 0;
  for (const auto& e : k.exprs) guarded += e.kind == ExprKind::Load && e.operands[0] >= 0;
  CHECK(guarded == 2);
  const auto cuda = kiln::codegen::cuda::emit_cuda_source(schedule, g);
  CHECK(cuda.kernels[0].strategy == "pointwise_vec4");
  CHECK(cuda.source.find(" ? *reinterpret_cast<const kiln::vec<float, 4>*>(buf") != std::string::npos);
  // halves of 30: a vector of 4 would straddle the two operands; of 2 it cannot
  CHECK(kiln::codegen::cuda::emit_cuda_source(kiln::fusion::schedule_kernels(cat_graph(30, 30)), cat_graph(30, 30))
            .kernels[0].strategy == "pointwise_vec2");
  const Graph odd = cat_graph(3, 5);
  CHECK(kiln::codegen::cuda::emit_cuda_source(kiln::fusion::schedule_kernels(odd), odd).kernels[0].strategy == "pointwise");
}

TEST_CASE("a slice's gradient with step 1 is a padded read of the gradient") {
  Graph g;
  ValueId grad = g.add_input(cpu({4, 3, 5}));
  ValueId out = g.add_node(op("aten::slice_backward", "default",
                              {TensorArg{grad}, std::vector<int64_t>{4, 6, 5}, int64_t{1}, int64_t{2}, int64_t{5}, int64_t{1}},
                              {"grad_output", "input_sizes", "dim", "start", "end", "step"}),
                           {cpu({4, 6, 5})})[0];
  g.set_outputs({out});
  const auto schedule = kiln::fusion::schedule_kernels(g);
  REQUIRE(schedule.kernels.size() == 1);
  REQUIRE(schedule.steps.size() == 1);
  const auto& k = schedule.kernels[0];
  const kiln::fusion::Expr* guarded = nullptr;
  for (const auto& e : k.exprs)
    if (e.kind == ExprKind::Load && e.operands[0] >= 0) guarded = &e;
  REQUIRE(guarded != nullptr);
  CHECK(guarded->index.offset == -2 * 5);  // row 2 of the input is row 0 of the gradient
  const auto& bound = k.exprs[guarded->operands[0]].bounds;
  REQUIRE(bound.size() == 1);
  CHECK(bound[0].extent == 3);
}
