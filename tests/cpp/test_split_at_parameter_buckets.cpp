// passes/split_at_parameter_buckets: a chain of Linear layers cut at DDP-sized buckets (torch-free, hand-built graphs).
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "graph/graph.h"
#include "passes/split_at_parameter_buckets.h"

using namespace kiln::graph;
using kiln::passes::ParameterBuckets;
using kiln::passes::split_at_parameter_buckets;
using kiln::passes::SplitGraph;

namespace {

TensorMeta cpu(std::vector<int64_t> sizes) {
  TensorMeta m;
  m.strides = contiguous_strides(sizes);
  m.sizes = std::move(sizes);
  m.requires_grad = true;
  return m;
}

Node op(const std::string& name, std::vector<ArgValue> args, std::vector<std::string> names, bool is_view = false) {
  Node n;
  n.op = name;
  n.overload = "default";
  n.args = std::move(args);
  n.arg_names = std::move(names);
  n.num_positional = static_cast<int32_t>(n.args.size());
  n.is_view = is_view;
  return n;
}

// x -> `layers` x relu(addmm(b, x, t(w))), 64 wide: 16,640 bytes of parameters per layer. With `view_before_last`, the
// last layer reads a view of the previous layer's output.
Graph linear_chain(int layers, ParameterBuckets& buckets, bool view_before_last = false) {
  Graph g;
  ValueId x = g.add_input(cpu({8, 64}));
  std::vector<std::pair<ValueId, ValueId>> params;
  for (int i = 0; i < layers; ++i) {
    buckets.parameter_inputs.push_back(static_cast<int32_t>(g.inputs.size()));
    ValueId w = g.add_input(cpu({64, 64}));
    buckets.parameter_inputs.push_back(static_cast<int32_t>(g.inputs.size()));
    params.push_back({w, g.add_input(cpu({64}))});
  }
  for (int i = 0; i < layers; ++i) {
    if (view_before_last && i == layers - 1)
      x = g.add_node(op("aten::view", {TensorArg{x}, std::vector<int64_t>{8, 64}}, {"self", "size"}, true),
                     {cpu({8, 64})})[0];
    ValueId t = g.add_node(op("aten::t", {TensorArg{params[i].first}}, {"self"}, true), {cpu({64, 64})})[0];
    ValueId y = g.add_node(op("aten::addmm", {TensorArg{params[i].second}, TensorArg{x}, TensorArg{t}},
                              {"self", "mat1", "mat2"}),
                           {cpu({8, 64})})[0];
    x = g.add_node(op("aten::relu", {TensorArg{y}}, {"self"}), {cpu({8, 64})})[0];
  }
  g.set_outputs({x});
  g.verify();
  return g;
}

std::vector<std::string> node_names(const Graph& g) {
  std::vector<std::string> out;
  for (const Node& n : g.nodes) out.push_back(n.op);
  return out;
}

}  // namespace

TEST_CASE("split_at_parameter_buckets: one piece per bucket, boundary values in slots", "[passes]") {
  ParameterBuckets buckets;
  buckets.bucket_bytes = buckets.first_bucket_bytes = 10485;  // bucket_cap_mb=0.01: one layer fills a bucket
  const Graph g = linear_chain(4, buckets);
  const SplitGraph split = split_at_parameter_buckets(g, buckets);
  REQUIRE(split.pieces.size() == 4);
  const int32_t first_made = static_cast<int32_t>(g.inputs.size());  // slot of the first piece's output
  for (size_t i = 0; i < 4; ++i) {
    const auto& piece = split.pieces[i];
    piece.graph->verify();
    CHECK(node_names(*piece.graph) == std::vector<std::string>{"aten::t", "aten::addmm", "aten::relu"});
    CHECK(piece.parameter_bytes == 16640);
    // w then b of layer i (t reads w first), then the activation: the caller's x, or the previous piece's output.
    const int32_t activation = i == 0 ? 0 : first_made + static_cast<int32_t>(i) - 1;
    CHECK(piece.input_slots == std::vector<int32_t>{1 + 2 * static_cast<int32_t>(i), 2 + 2 * static_cast<int32_t>(i),
                                                    activation});
    CHECK(piece.graph->outputs.size() == 1);
  }
  CHECK(split.output_slots == std::vector<int32_t>{first_made + 3});
}

TEST_CASE("split_at_parameter_buckets: the first bucket's cap, and one bucket keeps the graph whole", "[passes]") {
  ParameterBuckets buckets;
  buckets.bucket_bytes = 30000;  // two layers a bucket (DDP closes a bucket once it reaches the cap)
  buckets.first_bucket_bytes = 10000;  // the last layer alone
  const Graph g = linear_chain(5, buckets);
  const SplitGraph split = split_at_parameter_buckets(g, buckets);
  REQUIRE(split.pieces.size() == 3);
  CHECK(split.pieces[0].parameter_bytes == 2 * 16640);
  CHECK(split.pieces[1].parameter_bytes == 2 * 16640);
  CHECK(split.pieces[2].parameter_bytes == 16640);

  ParameterBuckets one;
  one.bucket_bytes = one.first_bucket_bytes = 1 << 20;
  const Graph small = linear_chain(4, one);
  CHECK(split_at_parameter_buckets(small, one).pieces.empty());
}

TEST_CASE("split_at_parameter_buckets: a cut never lets a view cross it", "[passes]") {
  ParameterBuckets buckets;
  buckets.bucket_bytes = buckets.first_bucket_bytes = 10485;
  const Graph g = linear_chain(2, buckets, /*view_before_last=*/true);
  const SplitGraph split = split_at_parameter_buckets(g, buckets);
  REQUIRE(split.pieces.size() == 2);
  // The bucket's cut falls before t(w1), where the view of the first relu would cross it: it moves before the view,
  // so the second piece makes its own view of the relu it reads.
  CHECK(node_names(*split.pieces[1].graph) ==
        std::vector<std::string>{"aten::view", "aten::t", "aten::addmm", "aten::relu"});
  CHECK(node_names(*split.pieces[0].graph) == std::vector<std::string>{"aten::t", "aten::addmm", "aten::relu"});
}
