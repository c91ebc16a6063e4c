// graph/specialise_sizes: a symbolic graph at one binding of its size symbols is a plain graph, equal to the captured
// one at the hints, with every meta and marked int argument evaluated elsewhere.
#include <catch2/catch.hpp>

#include "common/error.h"
#include "graph/graph.h"
#include "graph/graph_bytes.h"
#include "graph/propagate_symbolic_sizes.h"
#include "graph/specialise_sizes.h"

using namespace kiln::graph;

namespace {
TensorMeta dense(const std::vector<int64_t>& sizes) {
  TensorMeta meta;
  meta.sizes = sizes;
  meta.strides = contiguous_strides(sizes);
  return meta;
}

// (x + b).view(x.shape[0] // 2, -1, 8) at x [8, 16], b [16], with x's dims and b's dim symbolic (s0, s1, s2) and the
// view's first size marked as floordiv(s0, 2).
Graph symbolic_add_then_view() {
  Graph g;
  const ValueId x = g.add_input(dense({8, 16}));
  const ValueId b = g.add_input(dense({16}));
  Node add;
  add.op = "aten::add";
  add.overload = "Tensor";
  add.args = {TensorArg{x}, TensorArg{b}, int64_t{1}};
  add.arg_names = {"self", "other", "alpha"};
  add.num_positional = 2;
  const ValueId sum = g.add_node(add, {dense({8, 16})})[0];
  Node view;
  view.op = "aten::view";
  view.overload = "default";
  view.args = {TensorArg{sum}, std::vector<int64_t>{4, -1, 8}};
  view.arg_names = {"self", "size"};
  view.num_positional = 2;
  view.is_view = true;
  g.set_outputs({g.add_node(view, {dense({4, 4, 8})})[0]});
  const auto x_dims = mark_symbolic_dims(g, 0, {0, 1});
  mark_symbolic_dims(g, 1, {0});
  mark_symbolic_int_arg(g, {1, 1, 0, sym::floordiv(x_dims[0], 2)});
  propagate_symbolic_sizes(g);
  g.verify();
  return g;
}

std::string bytes_of(const Graph& g) {
  ByteWriter w;
  write_graph(w, g);
  return w.take();
}
}  // namespace

TEST_CASE("at the hints, the specialised graph is the captured one") {
  const Graph g = symbolic_add_then_view();
  auto at_hints = specialise_sizes(g, g.symbolic->hints());
  CHECK(at_hints->symbolic == nullptr);
  at_hints->verify();
  Graph captured = g;
  captured.symbolic = nullptr;
  CHECK(bytes_of(*at_hints) == bytes_of(captured));
  CHECK(at_hints->to_string() == captured.to_string());
  CHECK(at_hints->to_json() == captured.to_json());
}

TEST_CASE("elsewhere, metas and marked int arguments take the binding's values") {
  const Graph g = symbolic_add_then_view();
  REQUIRE(g.symbolic->symbols.size() == 3);
  sym::Bindings at;
  for (const SymbolOrigin& o : g.symbolic->symbols)  // x [6, 24], b [24]
    at[o.symbol.symbol_id()] = o.input_index == 0 && o.dim == 0 ? 6 : 24;
  auto s = specialise_sizes(g, at);
  s->verify();
  CHECK(s->symbolic == nullptr);
  CHECK(s->value(0).meta.sizes == std::vector<int64_t>{6, 24});
  CHECK(s->value(1).meta.sizes == std::vector<int64_t>{24});
  CHECK(s->value(2).meta.strides == std::vector<int64_t>{24, 1});
  CHECK(s->value(3).meta.sizes == std::vector<int64_t>{3, 6, 8});
  CHECK(std::get<std::vector<int64_t>>(s->nodes[1].args[1]) == std::vector<int64_t>{3, -1, 8});
  CHECK(std::get<int64_t>(s->nodes[0].args[2]) == 1);  // other ints as captured
  // The symbolic graph itself is untouched.
  CHECK(std::get<std::vector<int64_t>>(g.nodes[1].args[1]) == std::vector<int64_t>{4, -1, 8});
  CHECK(g.value(0).meta.sizes == std::vector<int64_t>{8, 16});
}

TEST_CASE("a graph without symbols is copied as it is, and an unbound symbol is an error") {
  Graph plain = symbolic_add_then_view();
  plain.symbolic = nullptr;
  CHECK(bytes_of(*specialise_sizes(plain, {})) == bytes_of(plain));
  const Graph g = symbolic_add_then_view();
  CHECK_THROWS_AS(specialise_sizes(g, {{g.symbolic->symbols[0].symbol.symbol_id(), 6}}), kiln::Error);
}
