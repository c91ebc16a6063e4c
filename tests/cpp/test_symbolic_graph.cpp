// graph/symbolic_sizes and graph/propagate_symbolic_sizes: marking input dims, propagation through the shape rules,
// specialisation, printing, the verifier, and the round trip of symbolic graphs through graph bytes and JSON; the
// tracer's placeholders and trace assumptions; graph/infer_recorded_sizes.
#include <catch2/catch.hpp>

#include "common/error.h"
#include "graph/graph.h"
#include "graph/graph_bytes.h"
#include "graph/infer_recorded_sizes.h"
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
  Node cumsum = make_node("aten::logcumsumexp.default", {TensorArg{3}, int64_t{1}}, {"self", "dim"});
  ValueId out = g.add_node(cumsum, {f32({4, 4, 8})})[0];
  g.set_outputs({out});
  mark_symbolic_dims(g, 0, {0});
  propagate_symbolic_sizes(g);
  g.verify(false);
  REQUIRE(g.symbolic->specialisations.size() == 1);
  CHECK(g.symbolic->specialisations[0].value == 8);
  CHECK(g.symbolic->specialisations[0].reason == "node 2 (aten::logcumsumexp.default): no rule for aten::logcumsumexp.default");
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

TEST_CASE("a tracer's input symbols and placeholders never share ids") {
  CHECK(input_size_symbol(1).to_string() == "s1");
  CHECK(size_placeholder_symbol(0).to_string() == "p0");
  CHECK(is_size_placeholder(size_placeholder_symbol(3)));
  CHECK_FALSE(is_size_placeholder(input_size_symbol(3)));
  Graph g = small_graph();
  mark_symbolic_dims(g, 0, {1, 0}, {input_size_symbol(0), input_size_symbol(1)});
  CHECK(symbolic_meta(g, 0).to_string() == "f32[s1, s0](s0, 1)");
  add_size_placeholder(g, {size_placeholder_symbol(0), 2, -1, {}});
  CHECK(g.symbolic->placeholders[0].dim == 1);
  // The other overload counts past the symbols given; placeholders are none of them.
  CHECK(mark_symbolic_dims(g, 1, {0})[0].to_string() == "s2");
  CHECK(g.symbolic->symbols.size() == 3);
  CHECK_THROWS_WITH(mark_symbolic_dims(g, 0, {0}, {input_size_symbol(5)}), Catch::Contains("symbolic already"));
  Graph h = small_graph();
  mark_symbolic_dims(h, 0, {0}, {input_size_symbol(0)});
  CHECK_THROWS_WITH(mark_symbolic_dims(h, 1, {0}, {input_size_symbol(0)}), Catch::Contains("another dim"));
  CHECK_THROWS_WITH(mark_symbolic_dims(h, 1, {0}, {size_placeholder_symbol(0)}), Catch::Contains("not an input"));
  CHECK_THROWS_WITH(add_size_placeholder(h, {input_size_symbol(4), 2, 0, {}}), Catch::Contains("not a size placeholder"));
  Graph ones;
  ones.add_input(f32({1, 8}));
  ones.set_outputs({0});
  CHECK_THROWS_WITH(mark_symbolic_dims(ones, 0, {0}, {input_size_symbol(0)}), Catch::Contains("sizes 0 and 1"));
}

TEST_CASE("placeholders resolve to their values' sizes before later rules read them") {
  Graph g = small_graph();  // x [8, 16] + b, then view(4, -1, 8)
  auto made = mark_symbolic_dims(g, 0, {0});
  const sym::Expr p0 = size_placeholder_symbol(0), p1 = size_placeholder_symbol(1);
  add_size_placeholder(g, {p0, 2, 0, {}});  // the sum's rows: s0
  add_size_placeholder(g, {p1, 1, 0, {}});  // b's only dim: concrete 16
  // view(p0 // 2, -1, 8), and the trace relied on p0 > 4 and p1 == 16.
  mark_symbolic_int_arg(g, {1, 1, 0, sym::floordiv(p0, 2)});
  add_trace_assumption(g, {shape::Assumption::Kind::kLt, 4, p0, "model.py:3"});
  add_trace_assumption(g, {shape::Assumption::Kind::kEq, p1, 16, "model.py:4"});
  CHECK_THROWS_WITH(add_trace_assumption(g, {shape::Assumption::Kind::kLt, p0, 4, "model.py:5"}),
                    Catch::Contains("does not hold"));
  CHECK_THROWS_WITH(add_trace_assumption(g, {shape::Assumption::Kind::kLt, size_placeholder_symbol(7), 4, "x"}),
                    Catch::Contains("neither an input symbol"));
  g.verify(false);  // (placeholders may stand in int arguments and trace assumptions before propagation)
  propagate_symbolic_sizes(g);
  g.verify(false);
  const SymbolicSizes& s = *g.symbolic;
  REQUIRE(s.placeholders.size() == 2);
  CHECK(s.placeholders[0].resolved->to_string() == "s0");
  CHECK(s.placeholders[1].resolved->to_string() == "16");
  CHECK(s.trace_assumptions.empty());
  REQUIRE(s.assumptions.size() == 2);  // (16 == 16 is dropped; the view's -1 needs a divisor)
  CHECK(s.assumptions[0].to_string() == "4 < s0");
  CHECK(s.assumptions[0].reason == "model.py:3");
  CHECK(s.facts.range(made[0].symbol_id()).lo == 5);
  CHECK(s.int_args[0].value.to_string() == "floordiv(s0, 2)");
  CHECK(symbolic_meta(g, 3).sizes[0].to_string() == "floordiv(s0, 2)");
  CHECK(s.symbols.size() == 1);
  // No placeholder may survive propagation anywhere but in `placeholders`.
  Graph broken = g;
  mutable_symbolic(broken).metas[3]->sizes[0] = p0;
  CHECK_THROWS_WITH(broken.verify(false), Catch::Contains("placeholder"));
}

TEST_CASE("a trace equality substitutes a symbol, or pins it to a constant") {
  Graph g = small_graph();
  auto made = mark_symbolic_dims(g, 0, {0, 1});
  mark_symbolic_dims(g, 1, {0});  // s2, which the add ties to s1
  const sym::Expr p0 = size_placeholder_symbol(0), p1 = size_placeholder_symbol(1);
  add_size_placeholder(g, {p0, 2, 0, {}});
  add_size_placeholder(g, {p1, 1, 0, {}});
  add_trace_assumption(g, {shape::Assumption::Kind::kEq, p1, p0 * 2, "model.py:8: assert"});
  add_trace_assumption(g, {shape::Assumption::Kind::kEq, p0, 8, "model.py:9: print(n)"});
  propagate_symbolic_sizes(g);
  g.verify(false);
  // x's s1 (b's s2) became s0 * 2 where the trace said so; then s0 is pinned where an int left for Python.
  CHECK(g.symbolic->assumptions[1].to_string() == "s1 == s0*2");
  CHECK(g.symbolic->assumptions[2].to_string() == "s0 == 8");
  REQUIRE(g.symbolic->specialisations.size() == 1);
  CHECK(g.symbolic->specialisations[0].symbol == made[0]);
  CHECK(g.symbolic->specialisations[0].reason == "model.py:9: print(n) (s0 == 8)");
  CHECK(g.symbolic->placeholders[1].resolved->to_string() == "16");
  CHECK(g.symbolic->meta(2) == nullptr);
}

namespace {
// infer_recorded_sizes for `op` on an input of symbolic `sizes` (hints from `hints`) and a size list `recorded`
// whose result has `output` sizes; every entry inferable.
std::string inferred(const std::string& op, const std::vector<sym::Expr>& sizes, const sym::Bindings& hints,
                     const std::vector<int64_t>& recorded, const std::vector<int64_t>& output) {
  shape::SymTensorMeta input;
  input.sizes = sizes;
  RecordedSizes r;
  r.input = &input;
  for (const sym::Expr& e : sizes) r.input_hints.push_back(e.evaluate(hints));
  r.sizes.assign(recorded.begin(), recorded.end());
  r.inferable.assign(recorded.size(), true);
  r.output_hints = output;
  r.hints = &hints;
  std::string text;
  for (const sym::Expr& e : infer_recorded_sizes(op, r)) text += (text.empty() ? "" : ", ") + e.to_string();
  return text;
}
}  // namespace

TEST_CASE("sizes ATen computed are read back from the input's sizes, or left where the hints are ambiguous") {
  const sym::Expr s0 = input_size_symbol(0), s1 = input_size_symbol(1);
  const std::string view = "aten::view.default";
  REQUIRE(recorded_size_args(view));
  CHECK_FALSE(recorded_size_args("aten::add.Tensor"));
  // linear's fold and unfold.
  CHECK(inferred(view, {s0, s1, 8}, {{0, 4}, {1, 6}}, {24, 8}, {24, 8}) == "s0*s1, 8");
  CHECK(inferred(view, {s0 * s1, 16}, {{0, 4}, {1, 6}}, {4, 6, 16}, {4, 6, 16}) == "s0, s1, 16");
  // bmm's batch times heads: the symbol before a part of the constant; the last takes what is left.
  CHECK(inferred("aten::_unsafe_view.default", {s0 * 4, s1, 8}, {{0, 2}, {1, 6}}, {2, 4, 6, 8}, {2, 4, 6, 8}) ==
        "s0, 4, s1, 8");
  CHECK(inferred(view, {s0 * s1}, {{0, 4}, {1, 6}}, {6, 4}, {6, 4}) == "s1, s0");
  // Two symbols of the same hint: nothing is guessed.
  CHECK(inferred(view, {s0 * s1, 16}, {{0, 6}, {1, 6}}, {6, 6, 16}, {6, 6, 16}) == "6, 6, 16");
  // A size no factor explains, -1 and size-1 entries stay; splitting a dim of a constant stays.
  CHECK(inferred(view, {s0 * s1}, {{0, 4}, {1, 6}}, {2, 12}, {2, 12}) == "2, 12");
  CHECK(inferred(view, {s0, s1, 8}, {{0, 4}, {1, 6}}, {4, -1, 1, 2, 4}, {4, 6, 1, 2, 4}) == "s0, -1, 1, 2, 4");
  // expand: the input's own (non-1) sizes; a broadcast 1 cannot say where its size came from.
  CHECK(inferred("aten::expand.default", {s0, 1, 8}, {{0, 4}}, {3, 4, 6, 8}, {3, 4, 6, 8}) == "3, s0, 6, 8");
}
