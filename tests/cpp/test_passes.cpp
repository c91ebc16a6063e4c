// passes/: the CUDA lowering passes on hand-built graphs (torch-free: CUDA metas need no GPU).
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <tuple>

#include "decomp/decompositions.h"
#include "graph/graph.h"
#include "passes/channels_last.h"
#include "passes/drop_absent_gradients.h"
#include "passes/fold_constants.h"
#include "passes/lower_batch_norm.h"
#include "passes/remove_dead_nodes.h"
#include "passes/simplify_algebra.h"
#include "passes/split_addmm.h"
#include "passes/stage_row_sums.h"

using namespace kiln::graph;

namespace {
TensorMeta cuda(std::vector<int64_t> sizes, ScalarType dtype = ScalarType::Float) {
  TensorMeta m;
  m.strides = contiguous_strides(sizes);
  m.sizes = std::move(sizes);
  m.dtype = dtype;
  m.device.type = DeviceType::CUDA;
  m.device.index = 0;
  return m;
}

Node op(const std::string& name, const std::string& overload, std::vector<ArgValue> args,
        std::vector<std::string> names, int32_t positional) {
  Node n;
  n.op = name;
  n.overload = overload;
  n.args = std::move(args);
  n.arg_names = std::move(names);
  n.num_positional = positional;
  return n;
}

// gelu(addmm(b, x, w)) on CUDA; `dtype` for every tensor.
Graph linear_gelu(ScalarType dtype, int64_t beta = 1) {
  Graph g;
  ValueId x = g.add_input(cuda({32, 10}, dtype));
  ValueId w = g.add_input(cuda({10, 50}, dtype));
  ValueId b = g.add_input(cuda({50}, dtype));
  ValueId y = g.add_node(op("aten::addmm", "default", {TensorArg{b}, TensorArg{x}, TensorArg{w}, beta, int64_t{1}},
                            {"self", "mat1", "mat2", "beta", "alpha"}, 3),
                         {cuda({32, 50}, dtype)})[0];
  ValueId z = g.add_node(op("aten::gelu", "default", {TensorArg{y}, std::string("none")}, {"self", "approximate"}, 1),
                         {cuda({32, 50}, dtype)})[0];
  g.set_outputs({z});
  return g;
}

std::vector<std::string> names(const Graph& g) {
  std::vector<std::string> out;
  for (const Node& n : g.nodes) out.push_back(n.qualified_name());
  return out;
}

Node conv(ValueId x, ValueId w) {
  return op("aten::convolution", "default",
            {TensorArg{x}, TensorArg{w}, NoneArg{}, std::vector<int64_t>{1, 1}, std::vector<int64_t>{1, 1},
             std::vector<int64_t>{1, 1}, false, std::vector<int64_t>{0, 0}, int64_t{1}},
            {"input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups"}, 9);
}

// conv(3 -> 32) -> relu [-> conv(32 -> 32)] on CUDA, 2x?x8x8.
Graph stem(bool with_wide_conv) {
  Graph g;
  ValueId x = g.add_input(cuda({2, 3, 8, 8}));
  ValueId w1 = g.add_input(cuda({32, 3, 3, 3}));
  ValueId y = g.add_node(conv(x, w1), {cuda({2, 32, 8, 8})})[0];
  ValueId r = g.add_node(op("aten::relu", "default", {TensorArg{y}}, {"self"}, 1), {cuda({2, 32, 8, 8})})[0];
  if (with_wide_conv) {
    ValueId w2 = g.add_input(cuda({32, 32, 3, 3}));
    r = g.add_node(conv(r, w2), {cuda({2, 32, 8, 8})})[0];
  }
  g.set_outputs({r});
  return g;
}
}  // namespace

constexpr int64_t kSMs = 132;

TEST_CASE("addmm with a bias vector on CUDA float32 becomes mm + a fusable bias add") {
  Graph g = linear_gelu(ScalarType::Float);
  const ValueId out = g.outputs[0];
  REQUIRE(kiln::passes::split_addmm_bias(g, kSMs));
  CHECK_NOTHROW(g.verify());
  CHECK(names(g) == std::vector<std::string>{"aten::mm.default", "aten::expand.default", "aten::add.Tensor",
                                             "aten::gelu.default"});
  const Value& bias = g.values[std::get<TensorArg>(g.nodes[2].args[1]).id];
  CHECK(bias.meta.sizes == std::vector<int64_t>{32, 50});
  CHECK(bias.meta.strides == std::vector<int64_t>{0, 1});
  CHECK(g.outputs[0] == out);
  // the add defines the addmm's own value, so gelu reads it unchanged
  CHECK(std::get<TensorArg>(g.nodes[3].args[0]).id == g.nodes[2].outputs[0]);
}

TEST_CASE("addmm stays whole in half precision, with beta != 1, and on CPU") {
  Graph half = linear_gelu(ScalarType::Half);
  CHECK_FALSE(kiln::passes::split_addmm_bias(half, kSMs));
  Graph scaled = linear_gelu(ScalarType::Float, 2);
  CHECK_FALSE(kiln::passes::split_addmm_bias(scaled, kSMs));
  Graph cpu = linear_gelu(ScalarType::Float);
  for (Value& v : cpu.values) v.meta.device = Device{};
  CHECK_FALSE(kiln::passes::split_addmm_bias(cpu, kSMs));
  CHECK(names(cpu)[0] == "aten::addmm.default");
}

// F.linear on [8, 512, 256] then `consumer`: addmm on the flattened rows, a view back to 3-d, the consumer.
Graph linear_3d(const std::string& consumer) {
  Graph g;
  ValueId x = g.add_input(cuda({4096, 256}));
  ValueId w = g.add_input(cuda({256, 1024}));
  ValueId b = g.add_input(cuda({1024}));
  ValueId y = g.add_node(op("aten::addmm", "default", {TensorArg{b}, TensorArg{x}, TensorArg{w}, int64_t{1}, int64_t{1}},
                            {"self", "mat1", "mat2", "beta", "alpha"}, 3),
                         {cuda({4096, 1024})})[0];
  Node view = op("aten::view", "default", {TensorArg{y}, std::vector<int64_t>{8, 512, 1024}}, {"self", "size"}, 2);
  view.is_view = true;
  ValueId v = g.add_node(view, {cuda({8, 512, 1024})})[0];
  Node last = op(consumer, "default", {TensorArg{v}, int64_t{0}, int64_t{1}}, {"self", "dim0", "dim1"}, 3);
  if (consumer == "aten::relu") {
    last.args.resize(1);
    last.arg_names.resize(1);
    last.num_positional = 1;
  }
  last.is_view = consumer == "aten::transpose";
  TensorMeta out = cuda({8, 512, 1024});
  if (last.is_view) {
    out.sizes = {512, 8, 1024};
    out.strides = {1024, 512 * 1024, 1};
  }
  g.set_outputs({g.add_node(last, {out})[0]});
  return g;
}

TEST_CASE("a large 3-d linear splits only when its consumer fuses the add, in the consumer's shape") {
  Graph fused = linear_3d("aten::relu");
  REQUIRE(kiln::passes::split_addmm_bias(fused, kSMs));
  CHECK_NOTHROW(fused.verify());
  CHECK(names(fused) == std::vector<std::string>{"aten::mm.default", "aten::view.default", "aten::expand.default",
                                                 "aten::add.Tensor", "aten::relu.default"});
  CHECK(fused.values[fused.nodes[3].outputs[0]].meta.sizes == std::vector<int64_t>{8, 512, 1024});
  Graph viewed = linear_3d("aten::transpose");  // nothing generated reads it: the bias stays in cuBLASLt
  CHECK_FALSE(kiln::passes::split_addmm_bias(viewed, kSMs));
}

TEST_CASE("an RGB stem convolution runs channels-last only in front of wider convolutions") {
  Graph alone = stem(false);
  CHECK_FALSE(kiln::passes::relayout_convolutions_channels_last(alone));
  Graph chain = stem(true);
  REQUIRE(kiln::passes::relayout_convolutions_channels_last(chain));
  CHECK_NOTHROW(chain.verify());
  // input and both weights relaid, the chain's result restored for the graph output
  int clones = 0;
  for (const Node& n : chain.nodes) clones += n.qualified_name() == "aten::clone.default";
  CHECK(clones == 4);
  for (const Node& n : chain.nodes) {
    if (n.qualified_name() != "aten::convolution.default") continue;
    const Value& input = chain.values[std::get<TensorArg>(n.args[0]).id];
    CHECK(input.meta.strides[1] == 1);  // channels-last: C innermost
  }
  CHECK(chain.values[chain.outputs[0]].meta.strides == contiguous_strides({2, 32, 8, 8}));
}

TEST_CASE("a ResNet stem (conv, batch norm, ReLU, max pool) stays channels-last into the next convolution") {
  Graph g;
  ValueId x = g.add_input(cuda({2, 3, 16, 16}));
  ValueId w1 = g.add_input(cuda({32, 3, 3, 3}));
  std::vector<ValueId> stats;
  for (int i = 0; i < 4; ++i) stats.push_back(g.add_input(cuda({32})));
  ValueId y = g.add_node(conv(x, w1), {cuda({2, 32, 16, 16})})[0];
  std::vector<ValueId> bn = g.add_node(
      op("aten::_native_batch_norm_legit_no_training", "default",
         {TensorArg{y}, TensorArg{stats[0]}, TensorArg{stats[1]}, TensorArg{stats[2]}, TensorArg{stats[3]}, 0.1, 1e-5},
         {"input", "weight", "bias", "running_mean", "running_var", "momentum", "eps"}, 7),
      {cuda({2, 32, 16, 16}), cuda({0}), cuda({0})});
  ValueId r = g.add_node(op("aten::relu", "default", {TensorArg{bn[0]}}, {"self"}, 1), {cuda({2, 32, 16, 16})})[0];
  std::vector<ValueId> pooled = g.add_node(
      op("aten::max_pool2d_with_indices", "default",
         {TensorArg{r}, std::vector<int64_t>{3, 3}, std::vector<int64_t>{2, 2}, std::vector<int64_t>{1, 1},
          std::vector<int64_t>{1, 1}, false},
         {"self", "kernel_size", "stride", "padding", "dilation", "ceil_mode"}, 6),
      {cuda({2, 32, 8, 8}), cuda({2, 32, 8, 8}, ScalarType::Long)});
  ValueId w2 = g.add_input(cuda({32, 32, 3, 3}));
  ValueId z = g.add_node(conv(pooled[0], w2), {cuda({2, 32, 8, 8})})[0];
  g.set_outputs({z});
  REQUIRE(kiln::passes::lower_inference_batch_norm(g));
  REQUIRE(kiln::passes::relayout_convolutions_channels_last(g));
  CHECK_NOTHROW(g.verify());
  for (const Node& n : g.nodes) {
    const std::string name = n.qualified_name();
    if (name == "aten::relu.default" || name == "aten::max_pool2d_with_indices.default" ||
        name == "aten::convolution.default") {
      INFO(name);
      CHECK(g.values[n.outputs[0]].meta.strides[1] == 1);
    }
  }
}

TEST_CASE("an autocast inference batch norm (cuDNN's, 16-bit input) lowers to float32 math and a cast that stay "
          "channels-last between the convolutions") {
  const ScalarType bf16 = ScalarType::BFloat16;
  Graph g;
  ValueId x = g.add_input(cuda({2, 32, 8, 8}, bf16));
  ValueId w1 = g.add_input(cuda({32, 32, 3, 3}, bf16));
  std::vector<ValueId> stats;
  for (int i = 0; i < 4; ++i) stats.push_back(g.add_input(cuda({32})));  // float32, as autocast leaves them
  ValueId y = g.add_node(conv(x, w1), {cuda({2, 32, 8, 8}, bf16)})[0];
  std::vector<ValueId> bn = g.add_node(
      op("aten::cudnn_batch_norm", "default",
         {TensorArg{y}, TensorArg{stats[0]}, TensorArg{stats[1]}, TensorArg{stats[2]}, TensorArg{stats[3]}, false, 0.1,
          1e-5},
         {"input", "weight", "bias", "running_mean", "running_var", "training", "exponential_average_factor",
          "epsilon"},
         8),
      {cuda({2, 32, 8, 8}, bf16), cuda({0}), cuda({0}), cuda({0}, ScalarType::Byte)});
  ValueId r = g.add_node(op("aten::relu", "default", {TensorArg{bn[0]}}, {"self"}, 1), {cuda({2, 32, 8, 8}, bf16)})[0];
  ValueId w2 = g.add_input(cuda({32, 32, 3, 3}, bf16));
  g.set_outputs({g.add_node(conv(r, w2), {cuda({2, 32, 8, 8}, bf16)})[0]});
  REQUIRE(kiln::passes::lower_inference_batch_norm(g));
  REQUIRE(kiln::passes::relayout_convolutions_channels_last(g));
  CHECK_NOTHROW(g.verify());
  int clones = 0, casts = 0;
  for (const Node& n : g.nodes) {
    const std::string name = n.qualified_name();
    CHECK(name.find("batch_norm") == std::string::npos);
    clones += name == "aten::clone.default";
    if (name == "aten::_to_copy.default") {
      ++casts;
      CHECK(g.values[std::get<TensorArg>(n.args[0]).id].meta.dtype == ScalarType::Float);
      CHECK(g.values[n.outputs[0]].meta.dtype == bf16);
    }
    if (name == "aten::_to_copy.default" || name == "aten::relu.default" || name == "aten::convolution.default") {
      INFO(name);
      CHECK(g.values[n.outputs[0]].meta.strides[1] == 1);
    }
  }
  CHECK(casts == 1);
  CHECK(clones == 4);  // the input and both weights relaid, the result restored: nothing between the convolutions
}

TEST_CASE("a 1x1 convolution's weight is channels-last already and is not copied") {
  Graph g;
  ValueId x = g.add_input(cuda({2, 32, 8, 8}));
  ValueId w1 = g.add_input(cuda({64, 32, 1, 1}));
  ValueId w2 = g.add_input(cuda({64, 64, 3, 3}));
  ValueId y = g.add_node(conv(x, w1), {cuda({2, 64, 8, 8})})[0];
  ValueId z = g.add_node(conv(y, w2), {cuda({2, 64, 8, 8})})[0];
  g.set_outputs({z});
  REQUIRE(kiln::passes::relayout_convolutions_channels_last(g));
  CHECK_NOTHROW(g.verify());
  std::vector<ValueId> cloned;
  for (const Node& n : g.nodes)
    if (n.qualified_name() == "aten::clone.default") cloned.push_back(std::get<TensorArg>(n.args[0]).id);
  // the input, the 3x3 weight, and the result restored for the graph output; not the 1x1 weight
  CHECK(cloned.size() == 3);
  CHECK(std::find(cloned.begin(), cloned.end(), w1) == cloned.end());
  CHECK(std::find(cloned.begin(), cloned.end(), w2) != cloned.end());
}

TEST_CASE("on CPU every float32 convolution runs channels-last, an RGB one alone included") {
  Graph g = stem(false);
  for (Value& v : g.values) v.meta.device = Device{};
  REQUIRE(kiln::passes::relayout_convolutions_channels_last(g));
  CHECK_NOTHROW(g.verify());
  // input and weight relaid; the ReLU follows and its result is restored for the graph output
  CHECK(names(g) == std::vector<std::string>{"aten::clone.default", "aten::clone.default", "aten::convolution.default",
                                             "aten::relu.default", "aten::clone.default"});
  CHECK(g.values[g.nodes[3].outputs[0]].meta.strides[1] == 1);
  CHECK(g.values[g.outputs[0]].meta.strides == contiguous_strides({2, 32, 8, 8}));
  Graph training = stem(true);  // the halves of a training step keep CPU convolutions as recorded
  for (Value& v : training.values) v.meta.device = Device{};
  CHECK_FALSE(kiln::passes::relayout_convolutions_channels_last(training, /*cpu=*/false));
  Graph doubles = stem(false);
  for (Value& v : doubles.values) {
    v.meta.device = Device{};
    v.meta.dtype = ScalarType::Double;
  }
  CHECK_FALSE(kiln::passes::relayout_convolutions_channels_last(doubles));
}

TEST_CASE("a value recorded channels-last leaves the graph without a copy back") {
  // A forward half whose captured graph was relaid before autodiff: its conv result is recorded channels-last.
  Graph g = stem(true);
  REQUIRE(kiln::passes::relayout_convolutions_channels_last(g));
  Graph again = g;
  for (ValueId& out : again.outputs) out = std::get<TensorArg>(again.nodes[again.values[out].producer].args[0]).id;
  again.set_outputs(again.outputs);  // the chain's channels-last result itself is the output now
  const size_t nodes = again.nodes.size();
  kiln::passes::relayout_convolutions_channels_last(again);
  CHECK_NOTHROW(again.verify());
  CHECK(again.nodes.size() == nodes);  // nothing cloned: the output keeps its recorded layout
  CHECK(again.values[again.outputs[0]].meta.strides[1] == 1);
}

TEST_CASE("an unread allocation (batch norm's recorded reserve) is dead") {
  Graph g;
  ValueId x = g.add_input(cuda({4}));
  Node empty = op("aten::empty", "memory_format",
                  {std::vector<int64_t>{0}, NoneArg{}, NoneArg{}, NoneArg{}, NoneArg{}, NoneArg{}},
                  {"size", "dtype", "layout", "device", "pin_memory", "memory_format"}, 1);
  g.add_node(empty, {cuda({0}, ScalarType::Byte)});
  ValueId y = g.add_node(op("aten::relu", "default", {TensorArg{x}}, {"self"}, 1), {cuda({4})})[0];
  g.set_outputs({y});
  kiln::passes::remove_dead_nodes(g);
  CHECK(names(g) == std::vector<std::string>{"aten::relu.default"});
}

namespace {
// gelu_backward-like producer [B, N, C] -> view [B * N, C] -> sum over rows (keepdim) -> view [C]: a bias gradient.
Graph flattened_row_sum(std::vector<int64_t> leading, ScalarType dtype, bool keepdim = true) {
  Graph g;
  std::vector<int64_t> shape = leading;
  shape.push_back(64);
  int64_t rows = 1;
  for (int64_t d : leading) rows *= d;
  ValueId x = g.add_input(cuda(shape, dtype));
  ValueId y = g.add_node(op("aten::relu", "default", {TensorArg{x}}, {"self"}, 1), {cuda(shape, dtype)})[0];
  Node view = op("aten::view", "default", {TensorArg{y}, std::vector<int64_t>{rows, 64}}, {"self", "size"}, 2);
  view.is_view = true;
  ValueId flat = g.add_node(view, {cuda({rows, 64}, dtype)})[0];
  std::vector<int64_t> out_shape = keepdim ? std::vector<int64_t>{1, 64} : std::vector<int64_t>{64};
  ValueId s = g.add_node(op("aten::sum", "dim_IntList", {TensorArg{flat}, std::vector<int64_t>{0}, keepdim, NoneArg{}},
                            {"self", "dim", "keepdim", "dtype"}, 3),
                         {cuda(out_shape, dtype)})[0];
  g.set_outputs({s, flat});
  return g;
}

std::vector<int64_t> sum_dims(const Node& n) { return std::get<std::vector<int64_t>>(n.args[1]); }
}  // namespace

TEST_CASE("a row sum of a flattened float32 view becomes two sums over the unflattened value") {
  Graph g = flattened_row_sum({8, 128}, ScalarType::Float);
  const ValueId out = g.outputs[0];
  const ValueId produced = g.nodes[0].outputs[0];
  REQUIRE(kiln::passes::stage_row_sums(g));
  CHECK_NOTHROW(g.verify());
  REQUIRE(names(g) == std::vector<std::string>{"aten::relu.default", "aten::view.default", "aten::sum.dim_IntList",
                                               "aten::sum.dim_IntList"});
  // the first stage reads relu's [8, 128, 64] result itself (so fusion can put it in relu's kernel)
  CHECK(std::get<TensorArg>(g.nodes[2].args[0]).id == produced);
  CHECK(sum_dims(g.nodes[2]) == std::vector<int64_t>{1});
  CHECK(g.values[g.nodes[2].outputs[0]].meta.sizes == std::vector<int64_t>{8, 64});
  CHECK(sum_dims(g.nodes[3]) == std::vector<int64_t>{0});
  CHECK(std::get<bool>(g.nodes[3].args[2]));
  CHECK(g.nodes[3].outputs[0] == out);  // the original output value, [1, 64]
  CHECK(g.values[out].meta.sizes == std::vector<int64_t>{1, 64});
  CHECK(g.values[out].producer == 3);
}

TEST_CASE("a float32 sum over leading dims that keeps them takes two stages, viewed back to its shape") {
  // RMSNorm's weight gradient as transformers' Llama writes it: (g * x).sum((0, 1), keepdim=True) of [8, 128, 64].
  Graph g;
  ValueId x = g.add_input(cuda({8, 128, 64}));
  ValueId y = g.add_node(op("aten::relu", "default", {TensorArg{x}}, {"self"}, 1), {cuda({8, 128, 64})})[0];
  ValueId s = g.add_node(op("aten::sum", "dim_IntList", {TensorArg{y}, std::vector<int64_t>{0, 1}, true, NoneArg{}},
                            {"self", "dim", "keepdim", "dtype"}, 3),
                         {cuda({1, 1, 64})})[0];
  g.set_outputs({s});
  REQUIRE(kiln::passes::stage_row_sums(g));
  CHECK_NOTHROW(g.verify());
  REQUIRE(names(g) == std::vector<std::string>{"aten::relu.default", "aten::sum.dim_IntList", "aten::sum.dim_IntList",
                                               "aten::view.default"});
  CHECK(sum_dims(g.nodes[1]) == std::vector<int64_t>{1});
  CHECK(g.values[g.nodes[1].outputs[0]].meta.sizes == std::vector<int64_t>{8, 64});
  CHECK(sum_dims(g.nodes[2]) == std::vector<int64_t>{0});
  CHECK_FALSE(std::get<bool>(g.nodes[2].args[2]));
  CHECK(g.nodes[3].outputs[0] == s);
  CHECK(g.values[s].meta.sizes == std::vector<int64_t>{1, 1, 64});
}

TEST_CASE("a row sum of a flattened view stays one sum in half precision and with short rows") {
  for (auto [leading, dtype, keepdim] : {std::tuple{std::vector<int64_t>{8, 128}, ScalarType::Half, true},
                                         std::tuple{std::vector<int64_t>{8, 128}, ScalarType::BFloat16, false},
                                         std::tuple{std::vector<int64_t>{64, 4}, ScalarType::Float, true},
                                         std::tuple{std::vector<int64_t>{1, 512}, ScalarType::Float, false}}) {
    Graph g = flattened_row_sum(leading, dtype, keepdim);
    const ValueId out = g.outputs[0];
    REQUIRE(kiln::passes::stage_row_sums(g));
    CHECK_NOTHROW(g.verify());
    const Node& sum = g.nodes[2];
    CHECK(sum.qualified_name() == "aten::sum.dim_IntList");
    CHECK(sum_dims(sum) == std::vector<int64_t>{0, 1});
    CHECK(std::get<TensorArg>(sum.args[0]).id == g.nodes[0].outputs[0]);
    CHECK(g.values[out].meta.dtype == dtype);
    if (keepdim) {  // [64] viewed as the node's [1, 64]
      REQUIRE(g.nodes.size() == 4);
      CHECK(g.nodes[3].qualified_name() == "aten::view.default");
      CHECK(g.nodes[3].outputs[0] == out);
    } else {
      CHECK(g.nodes.size() == 3);
      CHECK(sum.outputs[0] == out);
    }
  }
}

TEST_CASE("sums that are not row sums of a flattening view are left alone") {
  Graph cols = flattened_row_sum({8, 128}, ScalarType::Float);
  std::get<std::vector<int64_t>>(cols.nodes[2].args[1]) = {1};  // a sum over the columns
  CHECK_FALSE(kiln::passes::stage_row_sums(cols));
  Graph ints = flattened_row_sum({8, 128}, ScalarType::Long);  // integer sums promote: not rewritten
  CHECK_FALSE(kiln::passes::stage_row_sums(ints));
  Graph typed = flattened_row_sum({8, 128}, ScalarType::Float);
  typed.nodes[2].args[3] = ScalarTypeArg{ScalarType::Double};
  CHECK_FALSE(kiln::passes::stage_row_sums(typed));
}

TEST_CASE("a row sum stays one sum where fusion could not put it with its value's producer") {
  // x from an extern call (a matmul's result is a tensor the sum loads)
  Graph mm = flattened_row_sum({8, 128}, ScalarType::Float);
  mm.nodes[0].op = "aten::mm";
  mm.nodes[0].args.push_back(mm.nodes[0].args[0]);
  mm.nodes[0].arg_names = {"self", "mat2"};
  CHECK_FALSE(kiln::passes::stage_row_sums(mm));
  // x = relu(input) + (a sum over its last dim): its kernel reduces over C already
  Graph g;
  ValueId in = g.add_input(cuda({8, 128, 64}));
  ValueId r = g.add_node(op("aten::relu", "default", {TensorArg{in}}, {"self"}, 1), {cuda({8, 128, 64})})[0];
  ValueId s = g.add_node(op("aten::sum", "dim_IntList", {TensorArg{r}, std::vector<int64_t>{2}, true, NoneArg{}},
                            {"self", "dim", "keepdim", "dtype"}, 3),
                         {cuda({8, 128, 1})})[0];
  ValueId x = g.add_node(op("aten::add", "Tensor", {TensorArg{r}, TensorArg{s}, int64_t{1}}, {"self", "other", "alpha"}, 2),
                         {cuda({8, 128, 64})})[0];
  Node view = op("aten::view", "default", {TensorArg{x}, std::vector<int64_t>{1024, 64}}, {"self", "size"}, 2);
  view.is_view = true;
  ValueId flat = g.add_node(view, {cuda({1024, 64})})[0];
  ValueId total = g.add_node(op("aten::sum", "dim_IntList", {TensorArg{flat}, std::vector<int64_t>{0}, false, NoneArg{}},
                                {"self", "dim", "keepdim", "dtype"}, 3),
                             {cuda({64})})[0];
  g.set_outputs({total});
  CHECK_FALSE(kiln::passes::stage_row_sums(g));
}

TEST_CASE("exact identities read their operand; promotions, outputs and graphs that write in place keep them") {
  Graph g;
  ValueId x = g.add_input(cuda({4, 5}));
  auto binary = [&](const std::string& name, const std::string& overload, ValueId a, ArgValue other, TensorMeta meta) {
    return g.add_node(op(name, overload, {TensorArg{a}, other}, {"self", "other"}, 2), {meta})[0];
  };
  ValueId a = binary("aten::mul", "Tensor", x, int64_t{1}, cuda({4, 5}));
  ValueId b = binary("aten::div", "Tensor", a, 1.0, cuda({4, 5}));
  ValueId c = binary("aten::sub", "Tensor", b, int64_t{0}, cuda({4, 5}));
  ValueId d = binary("aten::add", "Tensor", c, int64_t{0}, cuda({4, 5}));  // not exact for -0.0: kept
  ValueId e = binary("aten::mul", "Tensor", d, 2.0, cuda({4, 5}));         // not an identity
  ValueId f = binary("aten::mul", "Tensor", e, int64_t{1}, cuda({4, 5}));  // a graph output: kept
  g.set_outputs({f});
  CHECK(kiln::passes::simplify_algebra(g) == 3);
  CHECK(std::get<TensorArg>(g.nodes[3].args[0]).id == x);  // the add reads x
  kiln::passes::remove_dead_nodes(g);
  CHECK(names(g) == std::vector<std::string>{"aten::add.Tensor", "aten::mul.Tensor", "aten::mul.Tensor"});
  g.verify();

  Graph h;  // a promotion: bool * 1 is int64
  ValueId m = h.add_input(cuda({3}, ScalarType::Bool));
  ValueId p = h.add_node(op("aten::mul", "Tensor", {TensorArg{m}, int64_t{1}}, {"self", "other"}, 2), {cuda({3}, ScalarType::Long)})[0];
  ValueId q = h.add_node(op("aten::add", "Tensor", {TensorArg{p}, int64_t{2}}, {"self", "other"}, 2), {cuda({3}, ScalarType::Long)})[0];
  h.set_outputs({q});
  CHECK(kiln::passes::simplify_algebra(h) == 0);

  Graph w;  // y = x * 1; x.add_(1); y + 0.5
  ValueId wx = w.add_input(cuda({3}));
  ValueId wy = w.add_node(op("aten::mul", "Tensor", {TensorArg{wx}, int64_t{1}}, {"self", "other"}, 2), {cuda({3})})[0];
  Node write = op("aten::add_", "Tensor", {TensorArg{wx}, int64_t{1}}, {"self", "other"}, 2);
  write.mutates_args = true;
  w.add_node(write, {cuda({3})});
  ValueId wz = w.add_node(op("aten::add", "Tensor", {TensorArg{wy}, 0.5}, {"self", "other"}, 2), {cuda({3})})[0];
  w.set_outputs({wz});
  CHECK(kiln::passes::simplify_algebra(w) == 0);
}

TEST_CASE("a gradient that does not come is a zero fill, and the sums it took part in are their other operand") {
  // Backward inputs: the gradients of two outputs (the second does not come), then a saved value.
  Graph g;
  ValueId g0 = g.add_input(cuda({4, 5}));
  ValueId g1 = g.add_input(cuda({4, 5}));
  ValueId saved = g.add_input(cuda({4, 5}));
  auto binary = [&](const std::string& name, ValueId a, ValueId b, TensorMeta meta) {
    return g.add_node(op(name, "Tensor", {TensorArg{a}, TensorArg{b}, int64_t{1}}, {"self", "other", "alpha"}, 2), {meta})[0];
  };
  auto product = [&](ValueId a, ValueId b) {
    return g.add_node(op("aten::mul", "Tensor", {TensorArg{a}, TensorArg{b}}, {"self", "other"}, 2), {cuda({4, 5})})[0];
  };
  ValueId local = product(g0, saved);
  ValueId sum = binary("aten::add", g1, local, cuda({4, 5}));   // 0 + local: local
  ValueId scaled = product(g1, saved);                            // zero
  ValueId both = binary("aten::sub", sum, scaled, cuda({4, 5}));  // local - 0: local
  ValueId out = product(both, saved);
  ValueId kept = binary("aten::add", g1, saved, cuda({4, 5}));    // a graph output: kept, reading the fill
  g.set_outputs({out, kept});
  int dropped = -1;
  std::shared_ptr<Graph> h = kiln::passes::drop_absent_gradients(g, {false, true}, &dropped);
  REQUIRE(h);
  CHECK(dropped == 2);
  CHECK(h->inputs.size() == 2);
  h->verify();
  kiln::passes::remove_dead_nodes(*h);
  CHECK(names(*h) == std::vector<std::string>{"aten::zeros.default", "aten::mul.Tensor", "aten::mul.Tensor",
                                              "aten::add.Tensor"});
  // The last product reads the first one's result: both sums are gone.
  CHECK(std::get<TensorArg>(h->nodes[2].args[0]).id == h->nodes[1].outputs[0]);

  Graph w;  // a gradient laid out as a transposed view is not replaced
  TensorMeta transposed = cuda({5, 4});
  transposed.strides = {1, 5};
  w.add_input(transposed);
  w.set_outputs({w.inputs[0]});
  CHECK_FALSE(kiln::passes::drop_absent_gradients(w, {true}));
}

TEST_CASE("constant folding plans the work that reads no input; fills, views, outputs and written storage stay") {
  Graph g;
  ValueId x = g.add_input(cuda({4, 4}));
  auto node = [&](const std::string& name, const std::string& overload, std::vector<ArgValue> args, TensorMeta meta) {
    std::vector<std::string> arg_names;
    for (size_t i = 0; i < args.size(); ++i) arg_names.push_back("a" + std::to_string(i));
    const auto positional = static_cast<int32_t>(args.size());
    Node n = op(name, overload, std::move(args), std::move(arg_names), positional);
    n.is_view = name == "aten::unsqueeze";
    return g.add_node(std::move(n), {std::move(meta)})[0];
  };
  ValueId full = node("aten::full", "default", {std::vector<int64_t>{4, 4}, -1.0}, cuda({4, 4}));
  ValueId mask = node("aten::triu", "default", {TensorArg{full}, int64_t{1}}, cuda({4, 4}));       // folded
  ValueId y = node("aten::add", "Tensor", {TensorArg{x}, TensorArg{mask}}, cuda({4, 4}));
  ValueId kept_fill = node("aten::full", "default", {std::vector<int64_t>{4, 4}, 2.0}, cuda({4, 4}));  // a fill: kept
  ValueId y2 = node("aten::mul", "Tensor", {TensorArg{y}, TensorArg{kept_fill}}, cuda({4, 4}));
  ValueId range = node("aten::arange", "default", {int64_t{4}}, cuda({4}, ScalarType::Long));
  ValueId half = node("aten::mul", "Tensor", {TensorArg{range}, 0.5}, cuda({4}));               // folded
  ValueId row = node("aten::unsqueeze", "default", {TensorArg{half}, int64_t{1}}, cuda({4, 1}));  // a view: kept
  ValueId y3 = node("aten::add", "Tensor", {TensorArg{y2}, TensorArg{row}}, cuda({4, 4}));
  ValueId noise = node("aten::rand", "default", {std::vector<int64_t>{4, 4}}, cuda({4, 4}));    // random: never
  ValueId y4 = node("aten::add", "Tensor", {TensorArg{y3}, TensorArg{noise}}, cuda({4, 4}));
  ValueId zeros = node("aten::zeros", "default", {std::vector<int64_t>{4, 4}}, cuda({4, 4}));
  ValueId sums = node("aten::cumsum", "default", {TensorArg{zeros}, int64_t{0}}, cuda({4, 4}));  // reads written storage
  ValueId y5 = node("aten::add", "Tensor", {TensorArg{y4}, TensorArg{sums}}, cuda({4, 4}));
  Node write = op("aten::add_", "Tensor", {TensorArg{zeros}, TensorArg{x}}, {"self", "other"}, 2);
  write.mutates_args = true;
  ValueId written = g.add_node(write, {cuda({4, 4})})[0];
  ValueId returned = node("aten::arange", "default", {int64_t{4}}, cuda({4}, ScalarType::Long));  // an output: never
  g.set_outputs({y5, written, returned});

  const kiln::passes::ConstantFolding plan = kiln::passes::plan_constant_folding(g, 1 << 20);
  CHECK(plan.values == std::vector<ValueId>{mask, half});
  CHECK(plan.nodes.size() == 4);  // full, triu, arange, mul
  CHECK(kiln::passes::plan_constant_folding(g, 32).values == std::vector<ValueId>{half});  // the 64-byte mask is too large

  // No tensors here: the verifier would refuse them.
  kiln::passes::fold_constants(g, plan, std::vector<kiln::graph::PyObjectRef>(2));
  CHECK(names(g) == std::vector<std::string>{"aten::add.Tensor", "aten::full.default", "aten::mul.Tensor",
                                             "aten::unsqueeze.default", "aten::add.Tensor", "aten::rand.default",
                                             "aten::add.Tensor", "aten::zeros.default", "aten::cumsum.default",
                                             "aten::add.Tensor", "aten::add_.Tensor", "aten::arange.default"});
  int constants = 0;
  for (const Value& v : g.values) constants += v.is_constant;
  CHECK(constants == 2);
  // Every read is of an input, a constant or an earlier node's result.
  for (NodeIndex i = 0; i < static_cast<NodeIndex>(g.nodes.size()); ++i)
    for (const ArgValue& arg : g.nodes[i].args)
      for_each_tensor(arg, [&](ValueId v) {
        const Value& read = g.value(v);
        CHECK((read.is_input || read.is_constant || (read.producer >= 0 && read.producer < i)));
      });
}
