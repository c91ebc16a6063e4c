// graph/symbolic_sizes and graph/propagate_symbolic_sizes: marking input dims, propagation through the shape rules,
// specialisation, printing, the verifier, and the round trip of symbolic graphs through graph bytes and JSON.
#include <catch2/catch.hpp>

#include "common/error.h"
#include "graph/graph.h"
#include "graph/graph_bytes.h"
#include "graph/propagate_symbolic_sizes.h"

using namespace kiln::graph;

namespace {
TensorMeta f32(std::vector<int64_t> sizes) {
  TensorMeta m;
  m.strides = contiguous_strides(sizes);
  m.sizes = std::move(sizes);
  return m;
}

Node make_node(const std::string& op, std::vector<ArgValue> args, std::vector<std::string> names) {
  Node n;
  n.op = op.substr(0, op.find('.'));
  n.overload = op.substr(op.find('.') + 1);
  n.num_positional = static_cast<int32_t>(args.size());
  n.args = std::move(args);
  n.arg_names = std::move(names);
  return n;
}

// y = (x + b).view(4, -1, 8) then cumsum over dim 1: x [8, 16], b [16].
Graph small_graph() {
  Graph g;
  ValueId x = g.add_input(f32({8, 16}));
  ValueId b = g.add_input(f32({16}));
  ValueId sum = g.add_node(make_node("aten::add.Tensor", {TensorArg{x}, TensorArg{b}, int64_t{1}},
                                     {"self", "other", "alpha"}),
                           {f32({8, 16})})[0];
  ValueId view = g.add_node(make_node("aten::view.default", {TensorArg{sum}, std::vector<int64_t>{4, -1, 8}},
                                      {"self", "size"}),
                            {f32({4, 4, 8})})[0];
  g.set_outputs({view});
  return g;
}

std::string bytes_of(const Graph& g) {
  ByteWriter w;
  write_graph(w, g);
  return w.take();
}

Graph from_bytes(const std::string& bytes) {
  ByteReader r(bytes);
  Graph g = read_graph(r);
  REQUIRE(r.at_end());
  return g;
}
}  // namespace

TEST_CASE("marked dims become symbols and propagate through the rules") {
  Graph g = small_graph();
  auto made = mark_symbolic_dims(g, 0, {0, 1});
  REQUIRE(made.size() == 2);
  CHECK(mark_symbolic_dims(g, 1, {0}).size() == 1);
  propagate_symbolic_sizes(g);
  g.verify(false);
  CHECK(symbolic_meta(g, 2).to_string() == "f32[s0, s1](s1, 1)");
  // b's s2 is tied to x's s1 by the broadcast; the view's -1 needs a divisor.
  const std::string text = g.to_string();
  CHECK(text.find("%2 : f32[s0, s1] = aten::add.Tensor") != std::string::npos);
  CHECK(text.find("# guard s1 == s2: node 0 (aten::add.Tensor): broadcast dim 1") != std::string::npos);
  CHECK(text.find("view's -1") != std::string::npos);
  REQUIRE(g.symbolic->specialisations.empty());
  TensorMeta at = evaluate_meta(g, 3, {{made[0].symbol_id(), 16}, {made[1].symbol_id(), 16}});
  CHECK(at.sizes == std::vector<int64_t>{4, 8, 8});
}

TEST_CASE("sizes 0 and 1 never become symbols, and a graph with none keeps its bytes") {
  Graph g;
  g.add_input(f32({1, 0}));
  g.set_outputs({0});
  const std::string before = bytes_of(g);
  CHECK(mark_symbolic_dims(g, 0, {0, 1}).empty());
  propagate_symbolic_sizes(g);
  CHECK(g.symbolic == nullptr);
  CHECK(bytes_of(g) == before);
  CHECK_THROWS_AS(mark_symbolic_dims(g, 0, {2}), kiln::Error);
  CHECK_THROWS_AS(mark_symbolic_dims(g, 1, {0}), kiln::Error);
}

TEST_CASE("a node without a rule pins the symbols it reads") {
  Graph g = small_graph();
  Node cumsum = make_node("aten::cumsum.default", {TensorArg{3}, int64_t{1}, NoneArg{}}, {"self", "dim", "dtype"});
  ValueId out = g.add_node(cumsum, {f32({4, 4, 8})})[0];
  g.set_outputs({out});
  mark_symbolic_dims(g, 0, {0});
  propagate_symbolic_sizes(g);
  g.verify(false);
  REQUIRE(g.symbolic->specialisations.size() == 1);
  CHECK(g.symbolic->specialisations[0].value == 8);
  CHECK(g.symbolic->specialisations[0].reason == "node 2 (aten::cumsum.default): no rule for aten::cumsum.default");
  CHECK(g.symbolic->meta(0) == nullptr);  // every meta concrete again
  CHECK(g.symbolic->facts.range(0).is_constant());
}

TEST_CASE("a symbolic int argument reaches the rule as its expression") {
  Graph g = small_graph();
  auto made = mark_symbolic_dims(g, 0, {0});
  // view(4, -1, 8) where the 4 is s0 // 2: -1 infers 4 whatever s0 is.
  mark_symbolic_int_arg(g, {1, 1, 0, kiln::graph::sym::floordiv(made[0], 2)});
  CHECK_THROWS_AS(mark_symbolic_int_arg(g, {1, 1, 1, made[0]}), kiln::Error);  // -1 is not s0 at the hints
  propagate_symbolic_sizes(g);
  g.verify(false);
  CHECK(symbolic_meta(g, 3).sizes[0].to_string() == "floordiv(s0, 2)");
}

TEST_CASE("symbolic graphs round-trip through bytes and JSON") {
  Graph g = small_graph();
  mark_symbolic_dims(g, 0, {0, 1});
  mark_symbolic_dims(g, 1, {0});
  propagate_symbolic_sizes(g);
  const std::string bytes = bytes_of(g);
  Graph back = from_bytes(bytes);
  back.verify(false);
  CHECK(back.to_string() == g.to_string());
  CHECK(bytes_of(back) == bytes);
  CHECK(back.symbolic->facts.divisor(0) == g.symbolic->facts.divisor(0));
  Graph from_json = graph_from_json(g.to_json());
  from_json.verify(false);
  CHECK(from_json.to_string() == g.to_string());
  CHECK(from_json.to_json() == g.to_json());
  CHECK(bytes_of(from_json) == bytes);
}

TEST_CASE("the verifier rejects symbolic metas that disagree with the concrete ones") {
  Graph g = small_graph();
  mark_symbolic_dims(g, 0, {0});
  propagate_symbolic_sizes(g);
  Graph broken = g;
  mutable_symbolic(broken).metas[2]->sizes[1] = 17;
  CHECK(g.symbolic->metas[2]->sizes[1] == 16);  // the copy did not share its change
  CHECK_THROWS_WITH(broken.verify(false), Catch::Contains("at the hints"));
}
